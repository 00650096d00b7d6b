"""Graceful shutdown: stop admitting, let in-flight requests finish, then say so.

:class:`Lifecycle` counts the generation requests in flight (from the first byte in to
the last byte out, streams included). Once :meth:`Lifecycle.drain` is called, new
requests get a 503 with ``Retry-After`` and ``/health`` answers 503 (load balancers stop
sending), while the requests already in flight run to the end; :meth:`wait_idle` tells
when they have, or that the grace period ran out.
"""

from __future__ import annotations

import asyncio


class Lifecycle:
    def __init__(self, max_in_flight: int | None = None) -> None:
        self.max_in_flight = max_in_flight  # more get a 429 (None: no cap here)
        self.draining = False
        self.in_flight = 0
        self._idle: asyncio.Event | None = None  # created on the serving loop

    @property
    def full(self) -> bool:
        return self.max_in_flight is not None and self.in_flight >= self.max_in_flight

    def drain(self) -> None:
        self.draining = True

    def enter(self) -> None:
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once nothing is in flight; False if ``timeout_s`` passed first."""
        if self.in_flight == 0:
            return True
        self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return self.in_flight == 0
        return True
