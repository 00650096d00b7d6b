"""``longspark serve`` as a user runs it: one replica serving its port itself, replaced
when it dies; SIGTERM: stop admitting (503), finish in-flight requests, exit.

On the way, the same server shows Serve's back-pressure as 429 with ``Retry-After`` and
the request id as Serve serves them (from the replica itself, direct ingress).

The real command in a subprocess (its own local Ray and Serve, a tiny random model with a
4K context and a random drafter). A long greedy stream is running when SIGTERM arrives:
new requests must get 503 ``shutting_down`` with ``Retry-After`` (and ``/health`` 503)
while the stream runs to its end, and the process must then exit by itself, cleanly.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from tests.conftest import make_tiny_chat_model
from tests.serving_helpers import engine_stats, free_port

pytestmark = pytest.mark.ray

GRACE_S = 240
LONGSPARK = Path(sys.executable).with_name("longspark")


@pytest.fixture
def server_process(tmp_path):
    path = make_tiny_chat_model(tmp_path / "tiny", max_position_embeddings=4096)
    port = free_port()
    log = (tmp_path / "serve.log").open("w")
    config = tmp_path / "serve.yaml"  # tiny queues, so overload is easy to reach
    config.write_text(
        "applications:\n  - name: longspark\n    import_path: services.serving.app:build_app\n"
        "    args: {cpus_per_actor: 0.5, max_ongoing_requests: 2, max_queued_requests: 1}\n"
    )
    cmd = [str(LONGSPARK), "serve", "--target", str(path), "--drafter", "random", "--k", "2"]
    cmd += ["--port", str(port), "--grace-period", str(GRACE_S), "--no-dashboard"]
    cmd += ["--config", str(config)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_DEDUP_LOGS": "0"}
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(1.0)
        yield proc, url, tmp_path / "serve.log"
    finally:
        if proc.poll() is None:  # only on failure: the whole group this test started
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        log.close()


def test_one_replica_serves_the_port_itself_and_its_replacement_takes_it_back(server_process):
    """Direct ingress (``longspark serve`` with one replica): the replica answers on the
    port, and after it dies the replica Serve starts in its place serves the same port."""
    proc, url, log = server_process
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    first = engine_stats(url)
    assert first["direct_ingress"] is True
    before = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert before.status_code == 200, before.text
    # the proxy's guard (api.proxy_guard) stands in front of the replica's server as well
    where = urlsplit(url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=60)
    raw = json.dumps(body).encode()
    conn.putrequest("POST", "/v1/completions")
    for name, value in [
        ("Content-Type", b"application/json"),
        ("Content-Length", str(len(raw)).encode()),
        ("X-Request-Id", b"\xff\xfe\x80"),
    ]:
        conn.putheader(name, value)
    conn.endheaders(raw)
    bad = conn.getresponse()
    assert bad.status == 400 and json.loads(bad.read())["error"]["code"] == "invalid_header"
    conn.close()
    os.kill(first["replica_pid"], signal.SIGKILL)
    deadline, after = time.monotonic() + 240, None
    while time.monotonic() < deadline and after is None:
        try:
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            if r.status_code == 200:
                after = r
            else:  # the dying replica's last answers: unavailable, never a bare 500
                assert r.status_code == 503, r.text
        except httpx.TransportError:  # between the two replicas nothing listens
            pass
        time.sleep(1.0)
    assert after is not None, log.read_text()[-3000:]
    assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]
    assert engine_stats(url)["replica_pid"] != first["replica_pid"]
    assert proc.poll() is None


def test_sigterm_drains_then_exits(server_process):
    proc, url, log = server_process
    model = "tiny"
    # long enough to outlast the burst and the drain's start on a fast host (800 tokens of the
    # tiny model once ended first); the 4K context holds it
    long_body = {"model": model, "prompt": "Hello world", "max_tokens": 3800, "stream": True}
    long_body.update(temperature=0, ignore_eos=True)
    small = {"model": model, "prompt": "Hi", "max_tokens": 2}
    # long enough to still hold its slot while the rest of the burst arrives (with two
    # tokens, a fast host finished each before the next reached the queue: all 200)
    held = {**small, "max_tokens": 48, "ignore_eos": True}

    async def scenario():
        async with httpx.AsyncClient(base_url=url, timeout=GRACE_S + 60) as c:
            started = asyncio.Event()

            async def in_flight() -> list[str]:
                events = []
                async with c.stream("POST", "/v1/completions", json=long_body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            started.set()
                            events.append(line[len("data: ") :])
                return events

            stream = asyncio.create_task(in_flight())
            await started.wait()
            traced = await c.post(
                "/v1/completions", json={**small, "model": "nope"}, headers={"X-Request-Id": "t-1"}
            )
            # one engine slot left and one queue place: a burst of six overflows Serve's queue
            burst = await asyncio.gather(*(c.post("/v1/completions", json=held) for _ in range(6)))
            proc.send_signal(signal.SIGTERM)
            refused = None
            for _ in range(300):
                r = await c.post("/v1/completions", json=small)
                if r.status_code == 503:
                    refused = r
                    break
                await asyncio.sleep(0.1)
            health = await c.get("/health")
            running = not stream.done()
            return traced, burst, refused, health, running, await stream

    traced, burst, refused, health, running_when_refused, events = asyncio.run(scenario())
    statuses = sorted(r.status_code for r in burst)
    assert set(statuses) <= {200, 429} and 429 in statuses and 200 in statuses, statuses
    busy = next(r for r in burst if r.status_code == 429)
    assert busy.json()["error"]["code"] == "server_busy" and busy.headers["retry-after"]
    # under Serve too: the client's request id, echoed once, in the error body
    assert traced.status_code == 404 and traced.json()["request_id"] == "t-1"
    assert traced.headers.get_list("x-request-id") == ["t-1"]
    assert refused is not None, log.read_text()[-3000:]
    assert refused.json()["request_id"] == refused.headers["x-request-id"]
    assert refused.json()["error"]["code"] == "shutting_down" and refused.headers["retry-after"]
    assert health.status_code == 503
    assert running_when_refused  # the drain began while the stream was still running
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"][0]["finish_reason"] == "length"
    assert not any('"error"' in e for e in events)
    assert proc.wait(GRACE_S + 60) == 0, log.read_text()[-3000:]
    assert "draining" in log.read_text()
