"""Draining the Serve app on SIGTERM: one signal the launcher sets, every ingress waits on.

``longspark serve`` creates a :class:`DrainSignal` actor (named per app) before it deploys
the app. Each ingress replica waits on it from its start (``signal.wait``); when the
launcher calls ``drain(grace_s)``, every replica stops admitting (503 + ``Retry-After``,
``/health`` 503), waits for its in-flight requests at most ``grace_s``, and reports back.
The launcher shuts Serve down once all have reported or the grace period is over.
Without the actor (``serve run`` of a config file) the ingress simply never drains itself.
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray

NAMESPACE = "serve"


def signal_name(app_name: str) -> str:
    return f"longspark-drain-{app_name}"


@ray.remote(num_cpus=0)
class DrainSignal:
    def __init__(self) -> None:
        self.grace_s: float | None = None
        self._set = asyncio.Event()
        self.reports: dict[str, bool] = {}  # ingress replica -> drained in time

    async def wait(self) -> float:
        """Returns the grace period once draining starts."""
        await self._set.wait()
        return float(self.grace_s or 0.0)

    async def drain(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self._set.set()

    async def report(self, replica: str, idle: bool) -> None:
        self.reports[replica] = idle

    async def num_reports(self) -> int:
        return len(self.reports)


def create_signal(app_name: str) -> Any:
    return DrainSignal.options(name=signal_name(app_name), namespace=NAMESPACE).remote()


def find_signal(app_name: str) -> Any | None:
    try:
        return ray.get_actor(signal_name(app_name), namespace=NAMESPACE)
    except ValueError:
        return None
