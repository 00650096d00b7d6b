"""Helpers shared by the serving tests: free ports, an app on a real local HTTP server,
a Ray Serve app started and shut down in-process, and engine-accounting polls."""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx

# Below the kernel's ephemeral range (32768+) and above Ray's worker ports (10002-19999):
# a port the kernel handed out as "free" could be taken by one of the many sockets Ray
# binds to port 0 while the server under test starts (CI saw exactly that).
_PORT_RANGE = (20000, 32767)


def free_port() -> int:
    """A port that is free now and that neither the kernel nor Ray hands out by itself."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randint(*_PORT_RANGE)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_PORT_RANGE}")


@contextmanager
def uvicorn_server(app: Any) -> Iterator[str]:
    """``app`` served by uvicorn on 127.0.0.1 in a thread (real sockets, real disconnects)."""
    import uvicorn

    config = uvicorn.Config(
        app, host="127.0.0.1", port=free_port(), log_level="warning", lifespan="on"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{config.port}"
    finally:
        server.should_exit = True
        thread.join(30)


@contextmanager
def serve_app(args: dict[str, Any], name: str = "longspark", num_cpus: int = 8) -> Iterator[str]:
    """The Serve app of ``services.serving.app.build_app(args)`` on a local Ray; its base URL.

    Starts Ray (unless one runs already) and Serve on a free port; shuts both down after.
    """
    import ray
    from ray import serve

    from api import proxy_guard
    from services.serving.app import build_app

    started = not ray.is_initialized()
    if started:
        proxy_guard.install()  # as ``longspark serve`` does
        ray.init(
            num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=False
        )
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(args), name=name, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        if started:
            ray.shutdown()


def engine_stats(base_url: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    return httpx.get(f"{base_url}/debug/engine", headers=headers or {}, timeout=60).json()


def wait_stats(
    base_url: str,
    ok: Callable[[dict[str, Any]], bool],
    timeout: float = 30.0,
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Poll /debug/engine until ``ok(stats)`` or ``timeout``; the last stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine_stats(base_url, headers)
        if ok(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def freed(stats: dict[str, Any]) -> bool:
    """Nothing running or waiting, no KV blocks, no drafter states (None: plain mode)."""
    return (
        stats["num_running"] == 0
        and stats["num_waiting"] == 0
        and stats["kv"]["used_blocks"] == 0
        and stats["kv"]["num_seqs"] == 0
        and stats.get("drafter_states") in (0, None)
    )
