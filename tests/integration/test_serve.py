"""The Serve app on a real local Ray: SmolLM2 at TP=3 (gloo) + a random drafter, over HTTP.

One app is shared by the module (Ray and Serve start once, ~25 s on 2 cores) and shut down
at the end. A random drafter is lossless, so greedy output over HTTP must equal plain
decoding token for token, whatever the drafter proposes, and after the drafter is killed.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import pytest

from tests import serving_helpers
from tests.serving_helpers import serve_app

pytestmark = [pytest.mark.ray, pytest.mark.slow]

KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(smollm2_path):
    """Base URL of the app (auth on); Ray with logical CPUs enough for the bundles."""
    args = dict(
        target=str(smollm2_path),
        tp=3,
        drafter="random",
        k=3,
        adaptive=False,  # a random drafter never pays: keep drafting to test the spec path
        max_num_seqs=32,
        kv_cache_tokens=32768,
        cpus_per_actor=0.5,
        api_key=KEY,
        drafter_timeout_s=20,
        # TP=3 against TP=1 in-process: only fp32 keeps their greedy text equal (through
        # bf16 GEMM inputs, the ranks' partial sums round differently)
        dtype="float32",
        quant="none",
        stream_interval=2,  # streams carry 2+ tokens a chunk after the first
    )
    with serve_app(args) as url:
        yield url


@pytest.fixture(scope="module")
def plain(smollm2_path):
    """Plain greedy decoding in this process (TP=1), the reference for every output."""
    from services.engine.backends import EngineOptions, build_engine

    engine, close = build_engine(
        EngineOptions(target=str(smollm2_path), mode="ar", dtype="float32", quant="none")
    )
    yield engine
    close()


def plain_ids(plain, prompts: list[list[int]], n: int) -> list[list[int]]:
    from services.engine.params import SamplingParams

    outs = plain.generate(prompts, SamplingParams(max_tokens=n))
    return [o.token_ids for o in outs]


def client(server, async_=False):
    from openai import AsyncOpenAI, OpenAI

    cls = AsyncOpenAI if async_ else OpenAI
    return cls(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=300)


def engine_stats(server) -> dict:
    return serving_helpers.engine_stats(server, AUTH)


def wait_stats(server, ok, timeout=30.0) -> dict:
    return serving_helpers.wait_stats(server, ok, timeout, AUTH)


def idle(stats) -> bool:
    return stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_completion_and_chat_equal_plain_decoding(server, plain):
    c = client(server)
    prompt = "The capital of France is"
    out = c.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    ids = plain.tok.encode(prompt)
    (want,) = plain_ids(plain, [ids], 12)
    assert out.model_extra["longspark"]["token_ids"] == want
    assert out.choices[0].text == plain.tok.decode(want)
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(want)
    assert out.model_extra["longspark"]["mode"] == "spec"
    assert out.model_extra["longspark"]["num_drafts"] > 0

    messages = [{"role": "user", "content": "Name a color."}]
    (want_chat,) = plain_ids(plain, [plain.tok.encode_chat(messages)], 10)
    chat = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert chat.choices[0].message.content == plain.tok.decode(want_chat)
    stream = c.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True
    )
    pieces = [ch.choices[0].delta.content for ch in stream if ch.choices]
    assert "".join(p or "" for p in pieces) == plain.tok.decode(want_chat)
    assert len([p for p in pieces if p]) <= 1 + -(-(len(want_chat) - 1) // 2)  # the interval
    assert [m.id for m in c.models.list().data] == [MODEL]


def test_32_concurrent_streams_complete_correctly(server, plain):
    prompts = [f"Question {i}: what is {i} plus {i + 1}? Answer:" for i in range(32)]
    want = plain_ids(plain, [plain.tok.encode(p) for p in prompts], 4)

    async def one(c, prompt):
        stream = await c.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=4,
            temperature=0,
            stream=True,
            extra_body={"return_token_ids": True},
        )
        last = None
        async for chunk in stream:
            last = chunk
        return last.model_extra["longspark"]["token_ids"]

    async def all_of_them():
        c = client(server, async_=True)
        return await asyncio.gather(*(one(c, p) for p in prompts))

    got = asyncio.run(all_of_them())
    assert got == want
    stats = wait_stats(server, idle)
    assert idle(stats) and stats["kv"]["used_blocks"] == 0
    print("admissions:", stats["admissions"])  # @serve.batch grouping (not asserted: timing)


def test_client_disconnect_frees_its_sequence(server):
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 400, "stream": True}
    body["ignore_eos"] = True
    with httpx.Client(timeout=120) as h:
        with h.stream("POST", f"{server}/v1/completions", json=body, headers=AUTH) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept open: leaving the loop would close the stream
            events = 0
            while events < 3:
                events += next(lines).startswith("data: ")
            running = engine_stats(server)
            assert running["num_running"] == 1 and running["kv"]["used_blocks"] > 0
            assert running["drafter_states"] == 1
    stats = wait_stats(
        server, lambda s: idle(s) and s["kv"]["used_blocks"] == 0 and s["drafter_states"] == 0
    )
    assert idle(stats), stats
    assert stats["kv"]["used_blocks"] == 0 and stats["kv"]["num_seqs"] == 0
    assert stats["drafter_states"] == 0
    assert stats["engine"]["rounds"] < running["engine"]["rounds"] + 20  # freed, not finished


def test_killing_the_drafter_mid_stream_falls_back_to_exact_plain_decoding(server, plain):
    prompts = ["Once upon a time", "The best way to learn is", "Water boils at", "My favorite"]
    want = plain_ids(plain, [plain.tok.encode(p) for p in prompts], 24)
    before = engine_stats(server)
    pid = before["drafter_pid"]

    async def one(c, prompt, started):
        stream = await c.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=24,
            temperature=0,
            stream=True,
            extra_body={"return_token_ids": True},
        )
        last = None
        async for chunk in stream:
            if last is None:
                started.release()
            last = chunk
        return last.model_extra["longspark"]["token_ids"]

    async def run_and_kill():
        c = client(server, async_=True)
        started = asyncio.Semaphore(0)
        tasks = [asyncio.create_task(one(c, p, started)) for p in prompts]
        for _ in prompts:
            await started.acquire()
        os.kill(pid, signal.SIGKILL)  # the drafter actor's process, mid-stream
        return await asyncio.gather(*tasks)

    got = asyncio.run(run_and_kill())
    assert got == want
    stats = wait_stats(server, lambda s: not s["drafter_restarting"] and s["drafter_pid"])
    assert not stats["drafter_restarting"] and stats["drafter_pid"] not in (None, pid)
    assert stats["drafter_fallbacks"] >= before["drafter_fallbacks"] + 1
    assert stats["drafter_restarts"] >= before["drafter_restarts"] + 1
    assert stats["drafter_pid"] != pid
    assert stats["failed_rounds"] == before["failed_rounds"]

    # new sequences draft again, with the restarted drafter, still exactly
    (again,) = plain_ids(plain, [plain.tok.encode("Once upon a time")], 8)
    out = client(server).completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=8,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert out.model_extra["longspark"]["token_ids"] == again
    assert out.model_extra["longspark"]["num_drafts"] > 0


def _post(server, body, headers=AUTH, raw=False):
    content = body if raw else json.dumps(body)
    hdrs = {"content-type": "application/json", **headers}
    return httpx.post(f"{server}/v1/completions", content=content, headers=hdrs, timeout=120)


def test_bad_requests_get_openai_errors_and_serving_goes_on(server):
    ok = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    cases = [
        (_post(server, b"{oops", raw=True), 400),
        (_post(server, {**ok, "max_tokens": "two"}), 400),
        (_post(server, {**ok, "max_tokens": -1}), 400),
        (_post(server, {**ok, "model": "gpt-4o"}), 404),
        (_post(server, {**ok, "prompt": "hello " * 9000}), 400),  # over the 8K context
        (_post(server, ok, headers={}), 401),
        (_post(server, ok, headers={"Authorization": "Bearer wrong"}), 401),
    ]
    for r, status in cases:
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert cases[4][0].json()["error"]["code"] == "context_length_exceeded"
    assert _post(server, ok).status_code == 200
    assert httpx.get(f"{server}/health", timeout=30).status_code == 200


def test_a_header_that_is_not_utf8_gets_a_400_from_the_proxy_guard(server):
    """Ray Serve's proxy decodes x-request-id itself (a bare 500 before the app runs);
    ``api.proxy_guard`` answers first, and serving goes on."""
    import http.client
    from urllib.parse import urlsplit

    where = urlsplit(server)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=60)
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    conn.putrequest("POST", "/v1/completions")
    for name, value in [
        ("Authorization", f"Bearer {KEY}".encode()),
        ("Content-Type", b"application/json"),
        ("Content-Length", str(len(body)).encode()),
        ("X-Request-Id", b"\xff\xfe\x80"),
    ]:
        conn.putheader(name, value)
    conn.endheaders(body.encode())
    r = conn.getresponse()
    assert r.status == 400 and r.getheader("content-type") == "application/json"
    err = json.loads(r.read())["error"]
    assert err["code"] == "invalid_header" and "x-request-id" in err["message"]
    conn.close()
    ok = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    assert _post(server, ok, headers={**AUTH, "X-Request-Id": "fine-1"}).status_code == 200
