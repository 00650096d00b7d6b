"""Faults on a real local Ray: a replica's engine (target rank and drafter as Ray actors,
the drafter behind ``ResilientDrafter``) served over HTTP on 127.0.0.1.

The replica is built exactly as a Serve engine replica builds it
(``services.serving.replica.build_replica_engine``) around a tiny random model, and the app
is served by uvicorn in a thread, so one module-wide set-up (seconds) covers:

* the drafter SIGKILLed mid-stream, stalled past its time-out, or SIGSTOPped: decoding
  goes on plain, greedy output stays token-identical to plain decoding, a fresh drafter
  takes over;
* the small load test (``services.bench.loadtest``): streaming and not, greedy and sampled,
  random disconnects, one drafter kill; nothing leaked at the end;
* a target rank SIGKILLed (last: it ends the replica): in-flight and new requests get
  clear 503s with Retry-After, none hangs, ``/health`` fails;
* a target rank SIGSTOPped (hung, not dead; a replica of its own): the watchdog
  (``rank_silence_s``) fails its streams with 503s too, instead of leaving them open.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import httpx
import pytest

from tests.conftest import make_tiny_chat_model
from tests.serving_helpers import engine_stats, freed, uvicorn_server, wait_stats

pytestmark = pytest.mark.ray

MODEL = "tiny-chat"
DRAFTER_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("faults"), max_position_embeddings=2048)


@contextlib.contextmanager
def serving_replica(tiny_path, **overrides):
    """(base URL, AsyncEngine) of one engine replica behind the OpenAI app."""
    from api.app import create_app
    from api.serving import OpenAIServing, ServingSettings
    from services.engine.async_engine import AsyncEngine, EngineLimits
    from services.serving.config import ServeArgs
    from services.serving.replica import build_replica_engine

    args = ServeArgs(
        target=str(tiny_path),
        model_name=MODEL,
        drafter="random",
        k=3,
        adaptive=False,  # a random drafter never pays: keep drafting to exercise its faults
        max_num_seqs=16,
        kv_cache_tokens=32768,
        cpus_per_actor=0.5,
        drafter_timeout_s=DRAFTER_TIMEOUT_S,
        target_process="actors",  # the rank as a Ray actor: its faults are injected here
        **overrides,
    ).resolved()
    engine, close, drafter = build_replica_engine(args)

    def replica_stats() -> dict:  # what EngineDeployment adds to /debug/engine
        return {
            **drafter.counters(),
            "drafter_pid": drafter.pid(),
            "target_pids": engine.target.pids(),
        }

    runner = AsyncEngine(
        engine, extra_stats=replica_stats, limits=EngineLimits(max_waiting=256, queue_timeout_s=120)
    )
    app = create_app(OpenAIServing(runner, ServingSettings(model_name=MODEL, max_tokens_limit=256)))
    try:
        with uvicorn_server(app) as url:
            yield url, runner
    finally:
        runner.shutdown()
        close()


@pytest.fixture(scope="module")
def replica(ray_local, tiny_path):
    with serving_replica(tiny_path) as served:
        yield served


@pytest.fixture(scope="module")
def plain(tiny_path):
    from services.engine.backends import EngineOptions, build_engine

    engine, close = build_engine(EngineOptions(target=str(tiny_path), mode="ar"))
    yield engine
    close()


def plain_ids(plain, prompt: str, n: int) -> list[int]:
    from services.engine.params import SamplingParams

    ids = plain.tok.encode(prompt)
    return plain.generate([ids], SamplingParams(max_tokens=n, ignore_eos=True))[0].token_ids


async def stream_ids(
    c: httpx.AsyncClient, prompt: str, n: int, started: asyncio.Event
) -> list[int]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
    body.update(ignore_eos=True, return_token_ids=True)
    last = None
    async with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                started.set()
                last = line
    import json

    return json.loads(last[len("data: ") :])["longspark"]["token_ids"]


PROMPTS = ["Hello world", "The quick brown fox", "The lazy dog", "Hello"]


def test_drafter_killed_mid_stream_output_stays_exact(replica, plain):
    url, _ = replica
    want = [plain_ids(plain, p, 200) for p in PROMPTS]
    before = engine_stats(url)

    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=300) as c:
            events = [asyncio.Event() for _ in PROMPTS]
            tasks = [
                asyncio.create_task(stream_ids(c, p, 200, e))
                for p, e in zip(PROMPTS, events, strict=True)
            ]
            await asyncio.gather(*(e.wait() for e in events))
            os.kill(before["drafter_pid"], signal.SIGKILL)
            return await asyncio.gather(*tasks)

    assert asyncio.run(go()) == want
    stats = wait_stats(url, lambda s: freed(s) and not s["drafter_restarting"], timeout=120)
    assert freed(stats) and stats["drafter_pid"] not in (None, before["drafter_pid"])
    assert stats["drafter_failures"] > before["drafter_failures"]
    assert stats["drafter_restarts"] > before["drafter_restarts"]
    assert stats["failed_rounds"] == before["failed_rounds"] and stats["drafter_enabled"]


def test_drafter_stalled_past_its_timeout_decoding_goes_on(replica, plain):
    import ray

    url, runner = replica
    drafter = runner.engine.drafter
    want = plain_ids(plain, "The lazy dog", 120)
    before = engine_stats(url)

    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=300) as c:
            started = asyncio.Event()
            task = asyncio.create_task(stream_ids(c, "The lazy dog", 120, started))
            await started.wait()
            drafter.inner.actor.__ray_call__.remote(lambda _: time.sleep(600))  # wedge it
            return await task

    t0 = time.monotonic()
    assert asyncio.run(go()) == want
    assert time.monotonic() - t0 < 30 * DRAFTER_TIMEOUT_S
    stats = wait_stats(url, lambda s: freed(s) and not s["drafter_restarting"], timeout=120)
    assert freed(stats) and stats["drafter_failures"] > before["drafter_failures"]
    assert stats["drafter_fallbacks"] > before["drafter_fallbacks"]
    assert stats["drafter_pid"] != before["drafter_pid"]  # the wedged actor was replaced
    # new requests draft again with the fresh actor, exactly
    r = httpx.post(
        f"{url}/v1/completions",
        json={"model": MODEL, "prompt": "Hello world", "max_tokens": 12, "temperature": 0}
        | {"ignore_eos": True, "return_token_ids": True},
        timeout=300,
    )
    assert r.json()["longspark"]["token_ids"] == plain_ids(plain, "Hello world", 12)
    assert r.json()["longspark"]["num_drafts"] > 0
    assert freed(wait_stats(url, freed))  # the drafter's free() is fire-and-forget
    assert ray.get(drafter.inner.actor.num_states.remote()) == 0


def test_drafter_stopped_decoding_goes_on_plainly(replica, plain):
    """SIGSTOP (a hung drafter process, not a slow call): the proposal times out, the
    round goes plain and exact, the stopped actor is replaced."""
    url, runner = replica
    want = plain_ids(plain, "The quick brown fox", 120)
    before = engine_stats(url)
    pid = before["drafter_pid"]

    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=300) as c:
            started = asyncio.Event()
            task = asyncio.create_task(stream_ids(c, "The quick brown fox", 120, started))
            await started.wait()
            os.kill(pid, signal.SIGSTOP)
            return await task

    try:
        assert asyncio.run(go()) == want
        stats = wait_stats(url, lambda s: freed(s) and not s["drafter_restarting"], timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    assert stats["drafter_failures"] > before["drafter_failures"]
    assert stats["drafter_fallbacks"] > before["drafter_fallbacks"]
    assert stats["drafter_pid"] != pid


def test_small_load_test_loses_nothing(replica, tiny_path):
    from services.bench.loadtest import LoadTestConfig, run

    url, _ = replica
    cfg = LoadTestConfig(
        url=url,
        requests=48,
        concurrency=12,
        time_limit_s=240,
        request_timeout_s=120,
        max_tokens=24,
        disconnect_fraction=0.25,
        faults=("drafter",),
        target=str(tiny_path),
    )
    report = run(cfg)
    print("load test:", report.to_dict())
    assert report.tried == 48 and sum(report.outcomes.values()) == 48
    assert report.faults["drafter"] > 0
    assert report.greedy_checked > 0 and report.greedy_mismatches == 0, report.problems
    assert report.outcomes.get("bad", 0) == 0 and report.outcomes.get("hung", 0) == 0
    assert report.outcomes.get("disconnected", 0) > 0
    assert not report.leaked and report.passed


def test_target_rank_stopped_is_caught_by_the_watchdog(ray_local, tiny_path):
    """A hung rank (SIGSTOP: alive, silent) must not hold its clients forever."""
    with serving_replica(tiny_path, rank_silence_s=2.0) as (url, _):
        pid = engine_stats(url)["target_pids"][0]
        try:
            streamed, after, health = asyncio.run(_fault_mid_stream(url, pid, signal.SIGSTOP))
        finally:
            os.kill(pid, signal.SIGCONT)
    _assert_replica_lost(streamed, after, health)


def test_target_rank_killed_gives_clear_503s_and_no_hung_client(replica):
    """Runs last: the replica is dead afterwards (Serve would replace it; see
    tests/integration/test_serve_autoscale.py for the replacement)."""
    url, _ = replica
    pid = engine_stats(url)["target_pids"][0]
    streamed, after, health = asyncio.run(_fault_mid_stream(url, pid, signal.SIGKILL))
    _assert_replica_lost(streamed, after, health)


async def _fault_mid_stream(
    url: str, pid: int, sig: int
) -> tuple[str, httpx.Response, httpx.Response]:
    """Send ``sig`` to a target rank while a stream runs; (the stream's lines, a request
    after it, /health)."""
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 200, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        started = asyncio.Event()

        async def in_flight() -> str:
            text = []
            async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                async for line in r.aiter_lines():
                    started.set()
                    text.append(line)
            return "\n".join(text)

        task = asyncio.create_task(in_flight())
        await started.wait()
        os.kill(pid, sig)
        streamed = await asyncio.wait_for(task, 120)  # no hung client
        after = await c.post("/v1/completions", json=body)
        health = await c.get("/health")
        return streamed, after, health


def _assert_replica_lost(streamed: str, after: httpx.Response, health: httpx.Response) -> None:
    assert '"error"' in streamed and "service_unavailable" in streamed
    assert streamed.rstrip().endswith("data: [DONE]")
    assert after.status_code == 503 and after.headers["retry-after"]
    assert after.json()["error"]["code"] == "replica_unavailable"
    assert health.status_code == 503
