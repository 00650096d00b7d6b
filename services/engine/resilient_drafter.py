"""A drafter handle that survives its actor: on death or timeout, decoding goes on plain.

Speculation is an optimisation, never a dependency. :class:`ResilientDrafter` wraps a
``RayDrafter`` (same interface, driven by the engine thread) and contains its failures:

* ``propose`` waits for the proposal at most ``timeout_s``. If the actor died, timed out
  or raised, the round gets no proposal (``None``: the engine verifies zero drafts, a
  plain decoding step, still exact), the actor is killed and a fresh one is started in
  the background, and every sequence the old actor held is *lost*: ``drafting(seq_id)``
  is False for it, so it finishes with plain decoding.
* New sequences arriving while the replacement starts are not waited for (that would
  stall every running sequence): they are marked lost and decode plainly. Once the
  replacement is up (checked, without waiting, at each round) new sequences draft
  again; if it fails as well, another one is started.
* Counters record it: ``fallbacks`` (rounds verified without a proposal because the
  drafter failed), ``failures``, ``restarts``, ``lost_sequences``.

The restarted drafter must hand the target the same summary queries ``G`` as the first
one (same checkpoint or same random seed); if it does not, drafting stays off.

The wrapper fetches each proposal (to see whether it failed) and passes the value on to
the target. Proposals are small (``[n, k, K_q]``; under Ray's 100 KiB inline limit they
reach the engine process with the reply anyway), so this costs little.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from target_actor.messages import DraftRequest, Proposal, scatter_proposal

log = logging.getLogger("longspark.drafter_faults")


class ResilientDrafter:
    """``RayDrafter``'s interface plus ``drafting(seq_id)``; see the module docstring."""

    def __init__(self, factory: Callable[[], Any], timeout_s: float = 30.0) -> None:
        import ray

        self._ray, self._factory, self.timeout_s = ray, factory, timeout_s
        self.inner = factory()
        self.cfg, self.k, self.window = self.inner.cfg, self.inner.k, self.inner.window
        self._queries: torch.Tensor | None = None
        self._restart: Future | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="drafter-restart")
        self.seen: set[int] = set()  # sequences the current actor drafted for
        self.lost: set[int] = set()  # sequences whose drafter state died with an actor
        self.enabled = True  # False once a replacement cannot serve these targets
        self.fallbacks = self.failures = self.restarts = self.lost_sequences = 0

    # -- the engine's calls ---------------------------------------------------------
    def drafting(self, seq_id: int) -> bool:
        return self.enabled and seq_id not in self.lost

    def summary_queries(self) -> torch.Tensor:
        self._queries = self.inner.summary_queries()
        return self._queries

    def prefill(self, views: Any) -> None:
        """Start sequences on the current actor; while a replacement starts, they go plain."""
        if not self.enabled:
            return
        self._poll_restart()
        if self._restart is None:
            try:
                self.inner.drop_pending([v.seq_id for v in views])
                self._ray.get(self.inner.remote("prefill", views), timeout=self.timeout_s)
                return
            except Exception as exc:  # noqa: BLE001 - actor death, timeout, task error
                self._failed(exc, [])
        self._lose(views)

    def _lose(self, views: Any) -> None:
        """Mark the sequences of ``views`` as decoding plainly."""
        ids = {v.seq_id for v in views}
        self.lost |= ids
        self.lost_sequences += len(ids)

    def propose(self, requests: list[DraftRequest], k: int, updates: Any = None) -> Proposal | None:
        self._poll_restart()
        rows = [i for i, r in enumerate(requests) if self.drafting(r.seq_id)]
        if not rows or self._restart is not None:
            return None
        part = [requests[i] for i in rows]
        self.seen.update(r.seq_id for r in part)
        try:
            ref = self.inner.remote("propose", part, k, self.inner.take_pending(updates))
            ready, _ = self._ray.wait([ref], timeout=self.timeout_s)
            if not ready:
                raise TimeoutError(f"no proposal within {self.timeout_s:g}s")
            proposal = self.inner.unpack(self._ray.get(ref))
        except Exception as exc:  # noqa: BLE001 - actor death, timeout, task error
            self.fallbacks += 1
            self._failed(exc, part)
            return None
        return scatter_proposal(proposal, rows, len(requests))

    def update(self, updates: Any) -> None:
        """A plain round's updates: held, or sent fire and forget (a dead actor shows at
        the next propose)."""
        self._poll_restart()
        if self.enabled and self._restart is None:
            self.inner.update(updates)

    def free(self, seq_ids: list[int]) -> None:
        live = [s for s in seq_ids if s not in self.lost]
        self.lost.difference_update(seq_ids)
        self.seen.difference_update(seq_ids)
        if live and self._restart is None:
            self.inner.free(live)

    def num_states(self) -> int | None:
        self._poll_restart()
        try:
            if self._restart is not None:
                return 0
            return self._ray.get(self.inner.actor.num_states.remote(), timeout=5)
        except Exception:  # noqa: BLE001 - stats only
            return None

    def pid(self) -> int | None:
        """The actor's process id (for stats and fault-injection tests)."""
        import os

        self._poll_restart()
        try:
            return self._ray.get(
                self.inner.actor.__ray_call__.remote(lambda w: os.getpid()), timeout=5
            )
        except Exception:  # noqa: BLE001
            return None

    def counters(self) -> dict[str, int | bool]:
        self._poll_restart()
        return {
            "drafter_fallbacks": self.fallbacks,
            "drafter_failures": self.failures,
            "drafter_restarts": self.restarts,
            "drafter_lost_sequences": self.lost_sequences,
            "drafter_enabled": self.enabled,
            "drafter_restarting": self._restart is not None,
        }

    def shutdown(self) -> None:
        if self._restart is not None:
            self._restart.cancel()
        self._kill()
        self._pool.shutdown(wait=False)

    # -- failures -------------------------------------------------------------------
    def _failed(self, exc: BaseException, requests: list[DraftRequest]) -> None:
        """Give up the current actor's sequences, kill it, start a replacement."""
        gone = self.seen | {r.seq_id for r in requests}
        self.lost |= gone
        self.lost_sequences += len(gone)
        self.seen.clear()
        self.failures += 1
        log.warning(
            "drafter failed (%s: %s); %d running sequences continue with plain decoding",
            type(exc).__name__,
            str(exc).splitlines()[0] if str(exc) else "",
            len(gone),
        )
        if self._restart is None:
            self._kill()
            self.restarts += 1
            self._restart = self._pool.submit(self._factory)

    def _poll_restart(self) -> None:
        """Take the replacement over once it is up (never waits)."""
        if self._restart is not None and self._restart.done():
            try:
                self._await_restart()
            except Exception as exc:  # noqa: BLE001 - the replacement failed: try again
                self._failed(exc, [])

    def _await_restart(self) -> None:
        if self._restart is None:
            return
        future, self._restart = self._restart, None
        fresh = future.result(timeout=max(self.timeout_s, 120.0))  # raises: caller restarts
        self.inner = fresh
        if self._queries is not None and not torch.equal(fresh.summary_queries(), self._queries):
            self.enabled = False
            log.error("the restarted drafter has other summary queries; drafting stays off")

    def _kill(self) -> None:
        try:
            self._ray.kill(self.inner.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
