"""What a client of vLLM's OpenAI server sends, with the official ``openai`` client:
n choices, prompt batches, logprobs, echo, penalties and vLLM's extras, tokenize /
detokenize / version, and the model's sampling defaults. In process (no Ray); the served
versions are in ``tests/integration/test_serve_parity.py``."""

from __future__ import annotations

import json

import pytest

from api.app import create_app
from api.serving import OpenAIServing, ServingSettings
from services.engine.params import SamplingParams
from tests.unit.test_api import MODEL, http, make_app, openai_client, plain_tokens, run


def test_n_seeded_choices_differ_and_repeat(engine):
    app = make_app(engine)

    async def go():
        client = openai_client(app)
        asked = dict(model=MODEL, prompt="The quick", max_tokens=8, temperature=1.0)
        asked["extra_body"] = {"ignore_eos": True}
        together = [await client.completions.create(n=3, seed=7, **asked) for _ in range(2)]
        alone = [await client.completions.create(seed=7 + i, **asked) for i in range(3)]
        return together, alone

    (first, again), alone = run(go())
    texts = [c.text for c in first.choices]
    # one prefill forked three ways answers as three requests of seeds 7, 8, 9 do
    assert [a.choices[0].text for a in alone] == texts
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert len(set(texts)) == 3  # each choice its own random stream (seed + index)
    assert [c.text for c in again.choices] == texts  # and the request is reproducible
    assert first.usage.completion_tokens == 3 * 8  # counted over every choice
    assert first.usage.prompt_tokens == len(engine.tok.encode("The quick"))


def test_prompt_batch_gives_a_choice_per_prompt_and_n(engine, plain):
    app = make_app(engine)
    prompts = ["The quick brown", "Hello world"]

    async def go():
        client = openai_client(app)
        return await client.completions.create(
            model=MODEL,
            prompt=prompts,
            n=2,
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True},
        )

    out = run(go())
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for i, prompt in enumerate(prompts):
        want = engine.tok.decode(plain_tokens(plain, engine.tok.encode(prompt), 6))
        assert out.choices[2 * i].text == out.choices[2 * i + 1].text == want
    assert out.usage.prompt_tokens == sum(len(engine.tok.encode(p)) for p in prompts)
    assert out.usage.completion_tokens == 4 * 6


def test_streamed_choices_carry_their_index(engine):
    app = make_app(engine)

    async def go():
        client = openai_client(app)
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hello"}],
            n=2,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        texts, reasons, usage = {0: "", 1: ""}, {}, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
                if c.finish_reason:
                    reasons[c.index] = c.finish_reason
        return texts, reasons, usage

    texts, reasons, usage = run(go())
    assert texts[0] == texts[1] and texts[0]
    assert reasons == {0: "length", 1: "length"}
    assert usage.completion_tokens == 12


def test_completion_logprobs_stream_and_whole_agree(engine):
    app = make_app(engine)
    kwargs = dict(model=MODEL, prompt="The quick", max_tokens=8, temperature=0, logprobs=3)

    async def go():
        client = openai_client(app)
        whole = await client.completions.create(**kwargs)
        stream = await client.completions.create(**kwargs, stream=True)
        parts = [c.choices[0].logprobs async for c in stream if c.choices]
        return whole, [p for p in parts if p is not None]

    whole, parts = run(go())
    lp = whole.choices[0].logprobs
    n = whole.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert "".join(lp.tokens) == whole.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and top[token] == value  # greedy: the chosen one is the top one
        assert len(top) <= 4 and max(top.values()) == value
    streamed = [v for p in parts for v in p.token_logprobs]
    assert streamed == lp.token_logprobs
    assert [o for p in parts for o in p.text_offset] == lp.text_offset


def test_chat_logprobs_and_top_logprobs(engine):
    app = make_app(engine)

    async def go():
        client = openai_client(app)
        return await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=5,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            extra_body={"ignore_eos": True},
        )

    out = run(go())
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob == item.logprob
        assert bytes(item.bytes).decode("utf-8") == item.token


def test_echo_puts_the_prompt_first(engine):
    app = make_app(engine)

    async def go():
        client = openai_client(app)
        whole = await client.completions.create(
            model=MODEL, prompt="The quick", max_tokens=4, temperature=0, echo=True
        )
        plain_out = await client.completions.create(
            model=MODEL, prompt="The quick", max_tokens=4, temperature=0
        )
        ids = engine.tok.encode("Hello world")
        by_ids = await client.completions.create(
            model=MODEL, prompt=ids, max_tokens=1, temperature=0, echo=True
        )
        return whole, plain_out, by_ids

    whole, plain_out, by_ids = run(go())
    assert whole.choices[0].text == "The quick" + plain_out.choices[0].text
    assert by_ids.choices[0].text.startswith("Hello world")


@pytest.fixture(scope="module")
def fp32_engine(tiny_chat):
    """Spec mode in fp32 weights, so prompt scores can be held to transformers' fp32."""
    from services.engine.async_engine import AsyncEngine
    from services.engine.backends import EngineOptions, build_engine

    eng, close = build_engine(
        EngineOptions(target=str(tiny_chat), drafter="random", k=4, dtype="float32", quant="none")
    )
    runner = AsyncEngine(eng)
    yield runner
    runner.shutdown()
    close()


def _reference_logprobs(path, ids: list[int]):
    """transformers' log-softmax at every place of ``ids`` (fp32), the independent check."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


@pytest.mark.parametrize("chunk", [None, 4])
def test_echo_with_logprobs_scores_the_prompt(fp32_engine, tiny_chat, chunk, monkeypatch):
    """vLLM's echo + logprobs: the prompt's tokens first (the first without a logprob),
    each scored by the model on what comes before it, streamed and whole alike; also
    when the prompt is prefilled in chunks (of 4 tokens here)."""
    if chunk is not None:
        monkeypatch.setattr("target_actor.verifier.PREFILL_TOKENS", chunk)
    prompt = "The quick brown fox jumps"
    ids = fp32_engine.tok.encode(prompt)

    async def go():
        client = openai_client(make_app(fp32_engine))
        kw = dict(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True)
        whole = await client.completions.create(**kw)
        stream = [c async for c in await client.completions.create(stream=True, **kw)]
        return whole, stream

    whole, stream = run(go())
    lp = whole.choices[0].logprobs
    assert whole.choices[0].text.startswith(prompt)
    assert len(lp.tokens) == len(ids) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = _reference_logprobs(tiny_chat, ids)
    for j in range(1, len(ids)):
        assert abs(lp.token_logprobs[j] - ref[j - 1, ids[j]].item()) <= 1e-4
        assert len(lp.top_logprobs[j]) >= 2  # the token itself and the 2 most likely
    streamed = [
        t
        for c in stream
        for t in (c.choices[0].logprobs.token_logprobs if c.choices[0].logprobs else [])
    ]
    assert streamed == lp.token_logprobs


def test_prompt_logprobs_extra(fp32_engine, tiny_chat):
    """vLLM's ``prompt_logprobs``: per prompt token its id -> logprob, rank, text."""
    messages = [{"role": "user", "content": "Hello there"}]
    ids = fp32_engine.tok.encode_chat(messages)

    async def go():
        async with http(make_app(fp32_engine)) as c:
            chat = await c.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": messages, "max_tokens": 2, "prompt_logprobs": 1},
            )
            cmpl = await c.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": ids, "max_tokens": 2, "prompt_logprobs": 0},
            )
            return chat.json(), cmpl.json()

    chat, cmpl = run(go())
    ref = _reference_logprobs(tiny_chat, ids)
    for entries in (chat["prompt_logprobs"], cmpl["choices"][0]["prompt_logprobs"]):
        assert len(entries) == len(ids) and entries[0] is None
        for j in range(1, len(ids)):
            mine = entries[j][str(ids[j])]
            assert abs(mine["logprob"] - ref[j - 1, ids[j]].item()) <= 1e-4
            assert mine["rank"] == int((ref[j - 1] > ref[j - 1, ids[j]]).sum()) + 1
    assert all(len(e) <= 2 for e in chat["prompt_logprobs"][1:])  # itself and the top 1


def test_penalties_reach_the_sampler(engine, plain):
    """A request's penalties give what the engine gives with the same settings."""
    app = make_app(engine)
    prompt = "The quick brown fox"
    settings = dict(presence_penalty=1.2, frequency_penalty=0.6)
    extras = dict(repetition_penalty=1.4, min_p=0.05, ignore_eos=True)

    async def go():
        client = openai_client(app)
        return await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=10, temperature=0, **settings, extra_body=extras
        )

    out = run(go())
    want = plain.generate(
        [engine.tok.encode(prompt)], SamplingParams(max_tokens=10, **settings, **extras)
    )[0]
    unpenalised = plain_tokens(plain, engine.tok.encode(prompt), 10)
    assert out.choices[0].text == engine.tok.decode(want.token_ids)
    assert want.token_ids != unpenalised


def test_logit_bias_and_stop_token_ids(engine):
    app = make_app(engine)
    banned = engine.tok.encode(" the", add_special_tokens=False)[0]

    async def go():
        client = openai_client(app)
        pushed = await client.completions.create(
            model=MODEL,
            prompt="Hello",
            max_tokens=5,
            temperature=0,
            logit_bias={str(banned): 100},
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        stopped = await client.completions.create(
            model=MODEL,
            prompt="Hello",
            max_tokens=5,
            temperature=0,
            logit_bias={str(banned): 100},
            extra_body={"stop_token_ids": [banned], "include_stop_str_in_output": True},
        )
        return pushed, stopped

    pushed, stopped = run(go())
    assert pushed.model_extra["longspark"]["token_ids"] == [banned] * 5
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1


def test_tokenize_detokenize_version_models(engine):
    app = make_app(engine)

    async def go():
        async with http(app) as c:
            tok = await c.post("/tokenize", json={"model": MODEL, "prompt": "Hello world"})
            chat = await c.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]})
            detok = await c.post("/detokenize", json={"tokens": tok.json()["tokens"]})
            bad = await c.post("/detokenize", json={"tokens": [10**9]})
            version = await c.get("/version")
            models = await c.get("/v1/models")
            metrics = await c.get("/metrics")
            return tok, chat, detok, bad, version, models, metrics

    tok, chat, detok, bad, version, models, metrics = run(go())
    assert tok.status_code == 200 and tok.json()["tokens"] == engine.tok.encode("Hello world")
    assert tok.json()["count"] == len(tok.json()["tokens"]) and tok.json()["max_model_len"] > 0
    assert chat.json()["tokens"] == engine.tok.encode_chat([{"role": "user", "content": "Hi"}])
    assert detok.json() == {"prompt": "Hello world"}
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert version.status_code == 200 and version.json()["version"]
    card = models.json()["data"][0]
    assert card["max_model_len"] == tok.json()["max_model_len"] and card["root"] == MODEL
    assert metrics.status_code == 404  # metrics are the Serve replica's (served tests)


def test_unset_sampling_fields_come_from_the_generation_config(engine, plain):
    settings = ServingSettings(model_name=MODEL, sampling_defaults={"temperature": 0.0})
    app = create_app(OpenAIServing(engine, settings))

    async def go():
        client = openai_client(app)
        return await client.completions.create(
            model=MODEL, prompt="The quick", max_tokens=6, extra_body={"ignore_eos": True}
        )

    out = run(go())
    want = plain_tokens(plain, engine.tok.encode("The quick"), 6)
    assert out.choices[0].text == engine.tok.decode(want)  # greedy, from the defaults


def test_generation_config_choices(tmp_path):
    from services.engine.generation_config import GenerationConfigError, sampling_defaults

    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.3, "top_k": 20, "do_sample": True, "max_length": 9})
    )
    assert sampling_defaults(tmp_path) == {"temperature": 0.3, "top_k": 20}
    assert sampling_defaults(tmp_path, "vllm") == {}
    assert sampling_defaults(tmp_path / "nowhere") == {}  # auto: a model without one
    with pytest.raises(GenerationConfigError, match="no generation_config.json"):
        sampling_defaults(tmp_path, str(tmp_path / "nowhere"))


def test_structured_outputs_follow_their_grammar(engine):
    import re

    app = make_app(engine)

    async def go():
        client = openai_client(app)
        regex = await client.completions.create(
            model=MODEL,
            prompt="The quick",
            max_tokens=20,
            temperature=1.0,
            seed=2,
            extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}},
        )
        choice = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "yes or no?"}],
            max_tokens=10,
            temperature=0,
            extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
        )
        schema = {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
            "required": ["ok", "n"],
            "additionalProperties": False,
        }
        as_json = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "JSON please"}],
            max_tokens=60,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        )
        return regex, choice, as_json

    regex, choice, as_json = run(go())
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", regex.choices[0].text)
    assert regex.choices[0].finish_reason == "stop"
    assert choice.choices[0].message.content in ("yes", "no", "maybe")
    if as_json.choices[0].finish_reason == "stop":  # a random model may run out of tokens
        value = json.loads(as_json.choices[0].message.content)
        assert set(value) == {"ok", "n"} and value["n"] in (1, 2, 3)


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"structured_outputs": {"regex": "("}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ],
)
def test_bad_grammars_are_400s(engine, extra, param):
    async def go():
        async with http(make_app(engine)) as c:
            return await c.post(
                "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3, **extra}
            )

    r = run(go())
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
