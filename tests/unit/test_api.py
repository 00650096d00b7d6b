"""The OpenAI API over an in-process AsyncEngine (no Ray): protocol, streaming, errors, auth.

A tiny random Qwen3 with a small byte-level BPE tokenizer and a chat template stands in
for the real model, so every test runs in seconds.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from api.app import WARNING_HEADER, create_app
from api.serving import OpenAIServing, ServingSettings
from services.engine.async_engine import AsyncEngine, GenerateRequest, RequestFailed
from services.engine.backends import EngineOptions, build_engine
from services.engine.params import SamplingParams

MODEL = "tiny-chat"


def make_app(engine, api_key=None, max_request_bytes=1 << 20):
    settings = ServingSettings(
        model_name=MODEL, mode="spec", api_key=api_key, max_request_bytes=max_request_bytes
    )
    return create_app(OpenAIServing(engine, settings))


def http(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def openai_client(app, api_key="unused"):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url="http://test/v1", api_key=api_key, http_client=http(app))


def run(coro):
    return asyncio.run(coro)


def plain_tokens(plain, ids: list[int], n: int) -> list[int]:
    return plain.generate([ids], SamplingParams(max_tokens=n, ignore_eos=True))[0].token_ids


def test_completion_greedy_equals_plain_decoding(engine, plain):
    app = make_app(engine)
    prompt = "The quick brown fox"

    async def go():
        client = openai_client(app)
        return await client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )

    out = run(go())
    ids = engine.tok.encode(prompt)
    want = plain_tokens(plain, ids, 12)
    assert out.choices[0].text == engine.tok.decode(want)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 12
    extras = out.model_extra["longspark"]
    assert extras["mode"] == "spec" and extras["rounds"] >= 1 and extras["num_drafts"] >= 1


def test_chat_stream_equals_non_stream(engine, plain):
    app = make_app(engine)
    messages = [{"role": "user", "content": "Hello there"}]

    async def go():
        client = openai_client(app)
        whole = await client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=10,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [c async for c in stream]
        return whole, chunks

    whole, chunks = run(go())
    want = engine.tok.decode(plain_tokens(plain, engine.tok.encode_chat(messages), 10))
    assert whole.choices[0].message.content == want
    assert whole.choices[0].message.role == "assistant"
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_sse_wire_format_ends_with_done(engine):
    async def go():
        async with http(make_app(engine)) as c:
            body = {"model": MODEL, "prompt": "Hello", "max_tokens": 5, "stream": True}
            r = await c.post("/v1/completions", json=body)
            return r

    r = run(go())
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][len("data: ") :])
    assert last["object"] == "text_completion" and last["choices"][0]["finish_reason"]


def test_seeded_sampling_is_reproducible(engine):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 8, "temperature": 0.9, "top_p": 0.9}
    body.update(top_k=20, seed=7)

    async def go():
        async with http(make_app(engine)) as c:
            a = await c.post("/v1/completions", json=body)
            b = await c.post("/v1/completions", json=body)
            return a.json(), b.json()

    a, b = run(go())
    assert a["choices"][0]["text"] == b["choices"][0]["text"]


BAD = [
    (b"{not json", 400, None, "json_invalid"),
    (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": "5"}), 400, "max_tokens", None),
    (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": -3}), 400, "max_tokens", None),
    (json.dumps({"model": MODEL, "prompt": "x", "temperature": -1}), 400, "temperature", None),
    (json.dumps({"model": MODEL, "prompt": "x", "top_p": 0}), 400, "top_p", None),
    (json.dumps({"model": MODEL, "prompt": "x", "n": 0}), 400, "n", None),
    (json.dumps({"model": MODEL, "prompt": "x", "n": 17}), 400, "n", None),
    (json.dumps({"model": MODEL, "prompt": "x", "logprobs": 21}), 400, "logprobs", None),
    (
        json.dumps({"model": MODEL, "prompt": "x", "prompt_logprobs": 21}),
        400,
        "prompt_logprobs",
        None,
    ),
    (json.dumps({"model": MODEL, "prompt": "x", "best_of": 3}), 400, "best_of", None),
    (json.dumps({"model": MODEL, "prompt": ["a", []]}), 400, "prompt", None),
    (
        json.dumps({"model": MODEL, "prompt": "x", "presence_penalty": 3}),
        400,
        "presence_penalty",
        None,
    ),
    (
        json.dumps({"model": MODEL, "prompt": "x", "repetition_penalty": 0}),
        400,
        "repetition_penalty",
        None,
    ),
    (json.dumps({"model": MODEL, "prompt": "x", "min_p": 1.5}), 400, "min_p", None),
    (json.dumps({"model": MODEL, "prompt": "x", "logit_bias": {"a": 1}}), 400, "logit_bias", None),
    (
        json.dumps({"model": MODEL, "prompt": "x", "logit_bias": {"99999999": 1}}),
        400,
        "logit_bias",
        None,
    ),
    (
        json.dumps({"model": MODEL, "prompt": "x", "stop_token_ids": [-1]}),
        400,
        "stop_token_ids",
        None,
    ),
    (
        json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 4, "min_tokens": 5}),
        400,
        "min_tokens",
        None,
    ),
    (
        json.dumps({"model": MODEL, "prompt": "x", "stream": True, "stream_interval": 0}),
        400,
        "stream_interval",
        None,
    ),
    (json.dumps({"model": MODEL}), 400, "prompt", None),
    (json.dumps({"model": "gpt-4", "prompt": "x"}), 404, "model", "model_not_found"),
    (json.dumps({"model": MODEL, "prompt": "word " * 400}), 400, None, "context_length_exceeded"),
]


@pytest.mark.parametrize("body,status,param,code", BAD)
def test_bad_completion_requests_get_openai_errors(engine, body, status, param, code):
    async def go():
        async with http(make_app(engine)) as c:
            bad = await c.post(
                "/v1/completions", content=body, headers={"content-type": "application/json"}
            )
            good = await c.post(
                "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}
            )
            return bad, good

    bad, good = run(go())
    assert bad.status_code == status, bad.text
    err = bad.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    assert good.status_code == 200  # and the service keeps serving


def test_chat_errors(engine):
    cases = [
        ({"model": MODEL, "messages": []}, 400, "messages"),
        (
            {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
            400,
            "messages.0.role",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{}]},
            400,
            "tools.0.type",
        ),
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_schema"},
            },
            400,
            "response_format",
        ),
    ]

    async def go():
        async with http(make_app(engine)) as c:
            return [await c.post("/v1/chat/completions", json=b) for b, _, _ in cases]

    for r, (_, status, param) in zip(run(go()), cases, strict=True):
        assert r.status_code == status, r.text
        assert r.json()["error"]["param"] == param


def test_unknown_fields_are_ignored_with_a_warning(engine):
    async def go():
        async with http(make_app(engine)) as c:
            return await c.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "mystery": 1},
            )

    r = run(go())
    assert r.status_code == 200 and "mystery" in r.headers[WARNING_HEADER]


def test_body_too_large_is_413(engine):
    async def go():
        async with http(make_app(engine, max_request_bytes=2048)) as c:
            return await c.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 5000})

    r = run(go())
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_auth(engine):
    app = make_app(engine, api_key="s3cret")

    async def go():
        async with http(app) as c:
            body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
            missing = await c.post("/v1/completions", json=body)
            wrong = await c.post(
                "/v1/completions", json=body, headers={"Authorization": "Bearer nope"}
            )
            models = await c.get("/v1/models")
            health = await c.get("/health")
        ok = await openai_client(app, api_key="s3cret").models.list()
        return missing, wrong, models, health, ok

    missing, wrong, models, health, ok = run(go())
    for r in (missing, wrong, models):
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert health.status_code == 200
    assert [m.id for m in ok.data] == [MODEL]


def test_models_and_unknown_routes(engine):
    async def go():
        async with http(make_app(engine)) as c:
            return (
                await c.get("/v1/models"),
                await c.get(f"/v1/models/{MODEL}"),
                await c.get("/v1/nope"),
            )

    models, one, nope = run(go())
    assert models.json()["data"][0]["id"] == MODEL and one.json()["id"] == MODEL
    assert nope.status_code == 404 and nope.json()["error"]["type"] == "not_found_error"


def test_abandoned_stream_frees_its_sequence(engine):
    async def go():
        req = GenerateRequest(SamplingParams(max_tokens=200, ignore_eos=True), prompt="Hello")
        gen = engine.generate(req)
        await anext(gen)
        await anext(gen)
        await gen.aclose()  # what a client disconnect does
        for _ in range(100):
            stats = await engine.stats()
            if stats["num_running"] == 0:
                return stats
            await asyncio.sleep(0.02)
        return stats

    stats = run(go())
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["kv"]["used_blocks"] == 0 and stats["drafter_states"] == 0


def test_abort_before_admission_keeps_the_request_from_starting(engine):
    async def go():
        req = GenerateRequest(SamplingParams(max_tokens=50), prompt="Hello")
        engine.abort(req.request_id)  # e.g. the client left while its batch was filling
        (result,) = await engine.admit([req])
        return result, await engine.stats()

    result, stats = run(go())
    assert isinstance(result, RequestFailed) and stats["num_running"] == 0


def test_a_failed_round_fails_its_requests_and_serving_goes_on(engine):
    target = engine.engine.target
    real_verify = target.verify
    calls = {"n": 0}

    def flaky(batch, proposal):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected verify failure")
        return real_verify(batch, proposal)

    async def go():
        async with http(make_app(engine)) as c:
            failed = await c.post(
                "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 8}
            )
            target.verify = real_verify
            ok = await c.post(
                "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3}
            )
            stats = await engine.stats()
            return failed, ok, stats

    target.verify = flaky
    try:
        failed, ok, stats = run(go())
    finally:
        target.verify = real_verify
    assert (
        failed.status_code == 500 and "injected verify failure" in failed.json()["error"]["message"]
    )
    assert ok.status_code == 200
    assert stats["engine"]["isolated_failures"] == 1 and stats["kv"]["used_blocks"] == 0


def test_dead_target_fails_requests_with_503_and_reports_unhealthy(tiny_chat):
    from ray.exceptions import ActorDiedError

    eng, close = build_engine(EngineOptions(target=str(tiny_chat), mode="ar", kv_cache_tokens=4096))
    runner = AsyncEngine(eng)

    def dead(batch, proposal):
        raise ActorDiedError()

    eng.target.verify = dead
    app = make_app(runner)

    async def go():
        async with http(app) as c:
            body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
            return (
                await c.post("/v1/completions", json=body),
                await c.post("/v1/completions", json=body),
                await c.get("/health"),
            )

    try:
        first, second, health = run(go())
    finally:
        runner.shutdown()
        close()
    assert first.status_code == 503 and second.status_code == 503
    assert health.status_code == 503
    with pytest.raises(Exception, match="target rank"):
        runner.check_health()


def test_request_failed_maps_to_500():
    from api.errors import to_api_error

    err = to_api_error(RequestFailed("boom"))
    assert err.status == 500 and err.body()["error"]["message"] == "boom"


def test_no_top_p_in_range_fails_a_request_or_its_neighbours(engine, plain):
    """Hostile top_p values (they once masked every token and failed the whole round)
    sharing rounds with a greedy stream: every request gets a 200, the stream its text."""
    app = make_app(engine)
    prompt = "The quick brown fox"
    tiny = [5e-324, 1e-320, 1e-46, 7e-46, 1e-10, 0.5, 1.0]

    async def go():
        client = openai_client(app)
        stream = await client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=40,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        first = await stream.__anext__()  # the stream is running: the others join its rounds
        async with http(app) as c:
            hostile = await asyncio.gather(
                *(
                    c.post(
                        "/v1/completions",
                        json={"model": MODEL, "prompt": "Hi", "max_tokens": 8, "top_p": v},
                    )
                    for v in tiny
                )
            )
        rest = [chunk async for chunk in stream]
        return [first, *rest], hostile

    chunks, hostile = run(go())
    assert [r.status_code for r in hostile] == [200] * len(tiny), [r.text for r in hostile]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == engine.tok.decode(plain_tokens(plain, engine.tok.encode(prompt), 40))


def test_deltas_queued_while_the_reader_was_busy_go_out_merged():
    """A slow reader gets one delta carrying everything queued, then the rest in order;
    the joined tokens and text are exactly what was put."""
    from services.engine.async_engine import RequestStream
    from services.engine.sequence import RequestOutput

    async def go():
        stream = RequestStream("r", asyncio.get_running_loop())
        outs = [RequestOutput("r", [i], f"t{i}", False, text="", token_ids=[]) for i in range(4)]
        outs.append(RequestOutput("r", [4], "t4", True, "length", "t0t1t2t3t4", [0, 1, 2, 3, 4]))
        for out in outs[:3]:
            stream.queue.put_nowait(out)
        got = []
        reader = AsyncEngine.__new__(AsyncEngine)  # stream() needs no engine until aborting
        async for delta in reader.stream(stream):
            got.append(delta)
            if len(got) == 1:
                for out in outs[3:]:
                    stream.queue.put_nowait(out)
        return got

    got = run(go())
    assert [d.new_token_ids for d in got] == [[0, 1, 2], [3, 4]]
    assert "".join(d.new_text for d in got) == "t0t1t2t3t4"
    assert got[-1].finished and got[-1].finish_reason == "length"


def test_a_stream_interval_holds_deltas_until_that_many_tokens_then_flushes_on_the_end():
    """vLLM's stream_interval: the first delta goes at once, then merged deltas of at least
    ``interval`` tokens; the last goes when the request finishes, and a failure first
    flushes what was held. Joined, the tokens and text are exactly what the engine put."""
    from services.engine.async_engine import RequestStream
    from services.engine.sequence import RequestOutput

    def outs(n: int, finish: bool) -> list[RequestOutput]:
        items = [RequestOutput("r", [i], f"t{i}", False, text="", token_ids=[]) for i in range(n)]
        if finish:
            items[-1] = RequestOutput("r", [n - 1], f"t{n - 1}", True, "length", "", [])
        return items

    async def go(items, interval, error=None):
        stream = RequestStream("r", asyncio.get_running_loop(), interval)
        for item in items:
            stream.put(item)
        if error is not None:
            stream.put(error)
        await asyncio.sleep(0)  # the loop runs the engine thread's call_soon_threadsafe
        got = []
        while not stream.queue.empty():
            got.append(stream.queue.get_nowait())
        return got

    got = run(go(outs(9, finish=True), 3))
    assert [d.new_token_ids for d in got] == [[0], [1, 2, 3], [4, 5, 6], [7, 8]]
    assert "".join(d.new_text for d in got) == "".join(f"t{i}" for i in range(9))
    assert got[-1].finished and not any(d.finished for d in got[:-1])

    boom = RequestFailed("the round failed")
    got = run(go(outs(3, finish=False), 4, error=boom))
    assert [d.new_token_ids for d in got[:-1]] == [[0], [1, 2]] and got[-1] is boom

    got = run(go(outs(5, finish=True), 1))
    assert [d.new_token_ids for d in got] == [[i] for i in range(5)]


def test_a_request_streaming_every_n_tokens_gets_the_same_text_in_fewer_chunks(engine, plain):
    """Over HTTP, ``stream_interval`` (a request may ask for more than the server's) keeps
    the output exactly plain decoding's while each chunk after the first carries at least
    that many tokens."""
    app = make_app(engine)
    prompt, n, interval = "Once upon a time", 40, 4

    async def go():
        client = openai_client(app)
        stream = await client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=n,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True, "stream_interval": interval},
        )
        return [chunk async for chunk in stream]

    chunks = [c for c in run(go()) if c.choices and c.choices[0].text]
    text = "".join(c.choices[0].text for c in chunks)
    assert text == engine.tok.decode(plain_tokens(plain, engine.tok.encode(prompt), n))
    assert len(chunks) <= 1 + -(-(n - 1) // interval), len(chunks)


def test_an_engine_builder_runs_on_the_engine_thread_and_its_error_reaches_the_caller(
    tiny_chat, plain
):
    """A replica whose rank computes in its own process builds the engine on the thread
    that runs its rounds (one OpenMP team, made there); a failed build fails the replica's
    constructor, not a background thread silently."""
    import threading

    built_on: list[str] = []

    def build():
        built_on.append(threading.current_thread().name)
        eng, _ = build_engine(EngineOptions(target=str(tiny_chat), mode="ar", kv_cache_tokens=4096))
        return eng

    runner = AsyncEngine(build)
    try:
        assert built_on == ["longspark-engine"] and runner.tok is runner.engine.tok
        ids = runner.tok.encode("Hello there")
        want = plain.generate([ids], SamplingParams(max_tokens=6, temperature=0))[0].token_ids

        async def go():
            outs = [
                o
                async for o in runner.generate(
                    GenerateRequest(SamplingParams(max_tokens=6, temperature=0), prompt=ids)
                )
            ]
            return outs[-1].token_ids

        assert asyncio.run(go()) == want
    finally:
        runner.shutdown()

    def broken():
        raise ValueError("no such checkpoint")

    with pytest.raises(ValueError, match="no such checkpoint"):
        AsyncEngine(broken)
