"""Tool calling: the prompt (tools folded into a template that lacks them), Hermes calls
parsed whole and streamed, ``tool_choice`` required / named held to their schemas, and a
tool round trip, over the API with the official ``openai`` client (in process, a tiny
random model; the served round trip is in ``tests/integration/test_serve_parity.py``)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from services.engine import tools
from tests.conftest import make_tiny_chat_model
from tests.unit.test_api import MODEL, http, make_app, openai_client, run


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory):
    """The API tests' tiny chat model with room for tool prompts (its tokenizer is small,
    so a prompt with two tool signatures runs to ~900 tokens)."""
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny-tools"), max_position_embeddings=2048)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'


# -- the pieces ---------------------------------------------------------------------------
def test_tools_fold_into_a_template_without_them():
    calls = [{"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Rome and Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "content": "21C", "tool_call_id": "c1"},
        {"role": "tool", "content": "3C", "tool_call_id": "c2"},
    ]
    out = tools.fold_into_messages(messages, [WEATHER])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert json.dumps(WEATHER) in out[0]["content"]
    assert json.loads(out[2]["content"].split("\n")[1]) == {
        "name": "get_weather",
        "arguments": {"city": "Rome"},
    }
    assert out[3]["content"] == (
        "<tool_response>\n21C\n</tool_response>\n<tool_response>\n3C\n</tool_response>"
    )
    assert tools.fold_into_messages(messages[:2], None) == messages[:2]  # no tools: as given


def test_hermes_parse_whole_and_streamed_agree():
    text = f"Let me look.\n{CALL_TEXT}\n{CALL_TEXT.replace('Paris', 'Oslo')}\n"
    content, calls = tools.parse_hermes(text)
    assert content == "Let me look."
    assert [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Oslo"]
    assert {c.name for c in calls} == {"get_weather"} and len({c.id for c in calls}) == 2
    for size in (1, 3, 7):  # any split of the text gives the same pieces
        stream = tools.HermesStream()
        parts = []
        for i in range(0, len(text), size):
            parts += stream.feed(text[i : i + size])
        parts += stream.finish()
        assert "".join(p for p in parts if isinstance(p, str)).strip() == content
        assert [c.arguments for c in stream.calls] == [c.arguments for c in calls]


def test_hermes_parse_keeps_what_is_not_a_call():
    assert tools.parse_hermes("a <tool_call> b") == ("a <tool_call> b", [])
    assert tools.parse_hermes("<tool_call>{oops}</tool_call>") == (
        "<tool_call>{oops}</tool_call>",
        [],
    )
    content, calls = tools.parse_hermes(CALL_TEXT.removesuffix("</tool_call>"))  # EOS first
    assert content is None and calls[0].name == "get_weather"
    assert tools.parse_hermes("x < y") == ("x < y", [])


def test_required_schema_takes_calls_to_the_given_tools_only():
    schema = tools.required_schema([WEATHER, CLOCK], parallel=True)
    ok = [{"name": "get_time", "parameters": {"zone": 2}}]
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "rm", "parameters": {}}], [{"name": "get_time", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ok * 2, tools.required_schema([CLOCK], parallel=False))


# -- over the API -------------------------------------------------------------------------
def _streamed_calls(chunks) -> tuple[str, dict[int, dict], list[str]]:
    """Content, calls (by index) and finish reasons, put together from stream deltas the
    way OpenAI's clients do it."""
    content, calls, reasons = "", {}, []
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or tc.id
                call["name"] += tc.function.name or ""
                call["arguments"] += tc.function.arguments or ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    return content, calls, reasons


async def _both(client, **kwargs):
    """The same greedy request whole and streamed."""
    whole = await client.chat.completions.create(model=MODEL, temperature=0, **kwargs)
    stream = await client.chat.completions.create(model=MODEL, temperature=0, stream=True, **kwargs)
    return whole, [c async for c in stream]


def test_named_tool_choice_gives_arguments_that_validate(engine):
    async def go():
        return await _both(
            openai_client(make_app(engine)),
            messages=ASK,
            tools=[WEATHER, CLOCK],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=80,
        )

    whole, chunks = run(go())
    msg = whole.choices[0].message
    assert msg.content is None and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    assert whole.choices[0].finish_reason == "stop"  # as OpenAI's named calls finish
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    content, calls, reasons = _streamed_calls(chunks)
    assert content == "" and reasons == ["stop"]
    assert calls[0]["name"] == "get_weather"
    assert calls[0]["arguments"] == call.function.arguments  # greedy: the same call


def test_required_tool_choice_calls_given_tools(engine):
    async def go():
        return await _both(
            openai_client(make_app(engine)),
            messages=ASK,
            tools=[WEATHER, CLOCK],
            tool_choice="required",
            parallel_tool_calls=False,  # one call: a random model would go on adding more
            max_tokens=200,
        )

    whole, chunks = run(go())
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    by_name = {"get_weather": WEATHER, "get_time": CLOCK}
    assert len(choice.message.tool_calls) == 1
    for call in choice.message.tool_calls:
        schema = by_name[call.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), schema)
    _, calls, reasons = _streamed_calls(chunks)
    assert reasons == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]


def test_auto_parses_hermes_calls_whole_and_streamed(engine):
    """A random model never writes a call by itself: a regex holds it to one, so the
    parser runs on real engine output, whole and in stream deltas."""
    regex = "Sure[.]\n" + CALL_TEXT.replace("{", "[{]").replace("}", "[}]")

    async def go():
        return await _both(
            openai_client(make_app(engine)),
            messages=ASK,
            tools=[WEATHER],
            max_tokens=200,
            extra_body={"structured_outputs": {"regex": regex}},
        )

    whole, chunks = run(go())
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "c"}
    content, calls, reasons = _streamed_calls(chunks)
    assert content.strip() == "Sure." and reasons == ["tool_calls"]
    assert (calls[0]["name"], calls[0]["arguments"]) == ("get_weather", call.function.arguments)


def test_tool_round_trip_and_tool_choice_none(engine):
    """The assistant's call and the tool's result go back in; the prompt the model sees
    is the folded one (checked through /tokenize), and the answer is plain text."""
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18C and sunny"},
    ]

    async def go():
        app = make_app(engine)
        client = openai_client(app)
        answer = await client.chat.completions.create(
            model=MODEL, messages=history, tools=[WEATHER], max_tokens=8, temperature=0
        )
        quiet = await client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=4
        )
        async with http(app) as c:
            tok = await c.post("/tokenize", json={"messages": history, "tools": [WEATHER]})
        return answer, quiet, tok

    answer, quiet, tok = run(go())
    assert answer.choices[0].message.content is not None
    folded = tools.fold_into_messages(
        [{**m, "content": m["content"] or ""} for m in history], [WEATHER]
    )
    want = engine.tok.encode_chat(folded)
    assert tok.json()["tokens"] == want
    assert answer.usage.prompt_tokens == len(want)
    assert "<tool_response>\n18C and sunny\n</tool_response>" in engine.tok.decode(want)
    # none: the tools stay out of the prompt
    assert quiet.usage.prompt_tokens == len(engine.tok.encode_chat(ASK))
    assert quiet.choices[0].message.tool_calls in (None, [])


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"tools": [{}]}, "tools.0.type"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
        ),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name"),
    ],
)
def test_bad_tool_requests_are_400s(engine, extra, param):
    async def go():
        async with http(make_app(engine)) as c:
            body = {"model": MODEL, "messages": ASK, "max_tokens": 2, **extra}
            return await c.post("/v1/chat/completions", json=body)

    r = run(go())
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
