"""A local Ray + Serve in this process, one app at a time (benchmarks start theirs here).

``bench throughput`` deploys the app once per mode (plain, then speculative) on the same
Ray and Serve, at the same address, so both modes are measured by the same command on
the same machine. Ray's metrics agent is pinned to a known port and reports every
second (its default is slower), so the benchmark can read the counters back quickly.
"""

from __future__ import annotations

import math
import os
import socket
from typing import Any

APP_NAME = "longspark-bench"
METRICS_REPORT_INTERVAL_MS = 1000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalService:
    """Context manager: Ray + Serve up on enter, down on exit; ``deploy`` one app at a time."""

    def __init__(self, num_cpus: float) -> None:
        self.num_cpus = max(os.cpu_count() or 1, math.ceil(num_cpus))
        self.port, self.metrics_port = free_port(), free_port()
        self._started = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def __enter__(self) -> LocalService:
        import ray
        from ray import serve

        from api import proxy_guard
        from services.serving.config import RAY_SYSTEM_CONFIG, quiet_ray_env

        if ray.is_initialized():
            raise RuntimeError(
                "Ray is already running in this process; use --url to bench a running service"
            )
        proxy_guard.install()  # as ``longspark serve`` does
        quiet_ray_env()
        ray.init(
            num_cpus=self.num_cpus,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
            _metrics_export_port=self.metrics_port,
            _system_config={
                **RAY_SYSTEM_CONFIG,
                "metrics_report_interval_ms": METRICS_REPORT_INTERVAL_MS,
            },
        )
        self._started = True
        serve.start(
            http_options={"host": "127.0.0.1", "port": self.port},
            logging_config={"log_level": "WARNING"},
        )
        return self

    def deploy(self, app_args: dict[str, Any]) -> str:
        """Deploy (replacing the previous app) and wait until it serves; its base URL."""
        from ray import serve

        from services.serving.app import build_app

        serve.run(
            build_app(app_args),
            name=APP_NAME,
            route_prefix="/",
            logging_config={"log_level": "WARNING"},
        )
        return self.url

    def undeploy(self) -> None:
        from ray import serve

        serve.delete(APP_NAME)

    def __exit__(self, *exc: object) -> None:
        import ray
        from ray import serve

        if self._started:
            try:
                serve.shutdown()
            finally:
                ray.shutdown()
