"""Autoscaling on a real local Ray: 1 -> 2 engine replicas under load, back to 1 when idle.

A tiny random model (with a real tokenizer) keeps it light; short upscale / downscale
delays keep it quick. Requests keep flowing while the second replica drains, and none
may fail. Both layouts: the API inside each engine replica (Serve's proxy balances them)
and a separate ingress in front of the engine replicas.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.conftest import make_tiny_chat_model
from tests.serving_helpers import serve_app

pytestmark = pytest.mark.ray

APP = "tiny"


@pytest.fixture(scope="module", params=["replica", "separate"])
def tiny_server(tmp_path_factory, request):
    path = make_tiny_chat_model(tmp_path_factory.mktemp("tiny-serve"))
    args = dict(
        ingress=request.param,
        target=str(path),
        model_name="tiny",
        tp=2,  # TP over Ray actors (gloo) in every replica
        drafter="random",
        k=2,
        kv_cache_tokens=8192,
        cpus_per_actor=0.5,
        min_replicas=1,
        max_replicas=2,
        target_ongoing_requests=2,
        upscale_delay_s=1.0,
        downscale_delay_s=4.0,
        metrics_interval_s=0.5,
        look_back_period_s=2.0,
        max_ongoing_requests=16,
    )
    with serve_app(args, name=APP) as url:
        yield url


def running_replicas() -> int:
    from ray import serve

    deployment = serve.status().applications[APP].deployments["LongSparkEngine"]
    return deployment.replica_states.get("RUNNING", 0)


def test_scales_up_under_load_and_back_down_without_failing_requests(tiny_server):
    body = {"model": "tiny", "prompt": "Hello world", "max_tokens": 48, "ignore_eos": True}
    body.update(temperature=0, stream=True)
    results: list[str] = []  # "ok", or what went wrong
    seen = {"max": running_replicas()}

    async def worker(c: httpx.AsyncClient, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    text = "".join([line async for line in r.aiter_lines()])
                ok = (
                    r.status_code == 200 and text.endswith("data: [DONE]") and '"error"' not in text
                )
                results.append("ok" if ok else f"{r.status_code}: {text[-300:]}")
            except Exception as exc:  # noqa: BLE001 - recorded, asserted below
                results.append(repr(exc))

    async def until(cond, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            n = running_replicas()
            seen["max"] = max(seen["max"], n)
            if cond(n):
                return True
            await asyncio.sleep(0.5)
        return False

    async def scenario() -> tuple[bool, bool]:
        async with httpx.AsyncClient(base_url=tiny_server, timeout=120) as c:
            heavy, light = asyncio.Event(), asyncio.Event()
            load = [asyncio.create_task(worker(c, heavy)) for _ in range(8)]
            trickle = asyncio.create_task(worker(c, light))
            up = await until(lambda n: n >= 2, timeout=90)
            heavy.set()  # sustained load ends; one request at a time keeps flowing
            await asyncio.gather(*load)
            down = await until(lambda n: n == 1, timeout=90)
            light.set()
            await trickle
            return up, down

    up, down = asyncio.run(scenario())
    assert up, f"never scaled to 2 replicas (max seen {seen['max']})"
    assert down, "never scaled back to 1 replica"
    assert results and all(r == "ok" for r in results), [r for r in results if r != "ok"][:3]


def test_dead_target_rank_gives_503_and_serve_replaces_the_replica(tiny_server):
    import os
    import signal

    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}
    stats = httpx.get(f"{tiny_server}/debug/engine", timeout=60).json()
    os.kill(stats["target_pids"][0], signal.SIGKILL)  # rank 0 of the only replica
    first = httpx.post(f"{tiny_server}/v1/completions", json=body, timeout=60)
    assert first.status_code == 503, first.text
    assert first.json()["error"]["type"] == "service_unavailable"

    statuses = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        r = httpx.post(f"{tiny_server}/v1/completions", json=body, timeout=60)
        statuses.append(r.status_code)
        if r.status_code == 200:
            break
        time.sleep(1.0)
    assert statuses[-1] == 200, statuses
    assert set(statuses) <= {200, 503}, statuses  # unavailable while replaced, never a 500
    after = httpx.get(f"{tiny_server}/debug/engine", timeout=60).json()
    assert after["replica"] != stats["replica"]
