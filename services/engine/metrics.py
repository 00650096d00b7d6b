"""Engine-wide counters and timings (vLLM's spec-decode vocabulary).

Plain counters here; the Serve deployment exports them to Prometheus
(``services.serving.metrics``). Cumulative totals only grow; the two :class:`TimingLog`
buffers hold per-round and per-request timings until the exporter drains them into
histograms (bounded, so an engine nobody exports keeps only the most recent).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from services.engine.sequence import Sequence, SpecStats


@dataclass
class TimingLog:
    """Recent observations (tuples of seconds), drained by the metrics exporter."""

    maxlen: int = 8192
    items: deque[tuple[float, ...]] = field(default_factory=deque)

    def add(self, *values: float) -> None:
        if len(self.items) >= self.maxlen:
            self.items.popleft()
        self.items.append(values)

    def drain(self) -> list[tuple[float, ...]]:
        out = list(self.items)
        self.items.clear()
        return out


@dataclass
class EngineStats:
    rounds: int = 0
    spec: SpecStats = field(default_factory=SpecStats)  # summed over every sequence-round
    num_generated_tokens: int = 0  # committed by rounds (a request's first token: prefill)
    draft_s: float = 0.0
    verify_s: float = 0.0
    round_s: float = 0.0
    finished: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)
    # per finished request: what its client got (stop-string cuts excluded, aborts included)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    drafter_sleeps: int = 0  # times the adaptive policy put the drafter aside
    drafter_probes: int = 0  # sequences admitted with drafter state while it was aside
    copy_drafts: int = 0  # sequence-rounds that drafted an engine-side context copy
    isolated_failures: int = 0  # requests a failing round or prefill finished alone
    split_rounds: int = 0  # failed verifies / prefills retried in halves to isolate them
    drafter_errors: int = 0  # proposals an in-process drafter raised on (those went plain)
    preemptions: int = 0  # sequences whose KV was dropped for others' (then recomputed)
    round_log: TimingLog = field(default_factory=TimingLog)  # (draft_s, verify_s, round_s)
    request_log: TimingLog = field(default_factory=TimingLog)  # (e2e_s,), aborts/errors excluded

    def observe_round(
        self,
        draft_s: float,
        verify_s: float,
        round_s: float,
        num_draft: list[int],
        num_accepted: list[int],
    ) -> None:
        self.rounds += 1
        self.draft_s += draft_s
        self.verify_s += verify_s
        self.round_s += round_s
        self.round_log.add(draft_s, verify_s, round_s)
        self.observe_tokens(num_draft, num_accepted)

    def observe_tokens(self, num_draft: list[int], num_accepted: list[int]) -> None:
        """What a verify committed (a round's, or a part's of a round verified apart)."""
        for nd, m in zip(num_draft, num_accepted, strict=True):
            self.num_generated_tokens += m + 1
            self.spec.observe(nd, m)

    def observe_finish(self, seq: Sequence) -> None:
        self.finished += 1
        self.finish_reasons[seq.finish_reason] = self.finish_reasons.get(seq.finish_reason, 0) + 1
        self.num_prompt_tokens += len(seq.prompt_ids)
        self.num_output_tokens += len(seq.output_ids)
        if seq.finish_reason not in ("abort", "error") and seq.finish_time is not None:
            self.request_log.add(seq.finish_time - seq.arrival_time)

    def summary(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "num_drafts": self.spec.num_drafts,
            "num_draft_tokens": self.spec.num_draft_tokens,
            "num_accepted_tokens": self.spec.num_accepted_tokens,
            "accepted_per_pos": list(self.spec.accepted_per_pos),
            "mean_accepted_length": round(self.spec.mean_accepted_length, 3),
            "num_generated_tokens": self.num_generated_tokens,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "draft_ms_per_round": round(1e3 * self.draft_s / max(1, self.rounds), 3),
            "verify_ms_per_round": round(1e3 * self.verify_s / max(1, self.rounds), 3),
            "round_ms": round(1e3 * self.round_s / max(1, self.rounds), 3),
            "drafter_sleeps": self.drafter_sleeps,
            "drafter_probes": self.drafter_probes,
            "copy_drafts": self.copy_drafts,
            "isolated_failures": self.isolated_failures,
            "split_rounds": self.split_rounds,
            "drafter_errors": self.drafter_errors,
            "preemptions": self.preemptions,
        }
