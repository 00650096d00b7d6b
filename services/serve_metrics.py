"""Prometheus metrics of an engine replica, exported through Ray's metrics agent.

Names follow vLLM's (``vllm:spec_decode_num_drafts`` -> ``longspark_spec_decode_num_drafts``;
Ray forbids ``:`` and prefixes ``ray_``), so dashboards built for vLLM's spec-decode
metrics read them with a prefix change. Counters are exported as increments of the
engine's cumulative ``EngineStats``; a snapshot is taken on the engine thread (between
rounds), the export happens on the replica's event loop.
"""

from __future__ import annotations

from typing import Any

from ray.util import metrics

from .engine import Engine

LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]

COUNTERS = {
    "spec_decode_num_drafts": "rounds that verified at least one draft token",
    "spec_decode_num_draft_tokens": "draft tokens verified",
    "spec_decode_num_accepted_tokens": "draft tokens accepted",
    "generation_tokens": "tokens generated",
    "rounds": "engine rounds",
    "request_success": "requests finished",
}
GAUGES = {
    "num_requests_running": "sequences in the running batch",
    "num_requests_waiting": "requests waiting for admission",
    "kv_cache_usage_perc": "fraction of the KV-cache token budget reserved (0..1)",
    "spec_decode_mean_accepted_length": "tokens committed per drafting round (tau)",
    "round_time_ms": "mean round time (draft + verify + commit)",
    "draft_time_ms": "mean drafting time per round",
    "verify_time_ms": "mean verification time per round",
}


class EngineMetrics:
    def __init__(self, model_name: str) -> None:
        self.tags = {"model_name": model_name}
        keys = ("model_name",)
        self.counters = {
            n: metrics.Counter(f"longspark_{n}", d, tag_keys=keys) for n, d in COUNTERS.items()
        }
        self.gauges = {
            n: metrics.Gauge(f"longspark_{n}", d, tag_keys=keys) for n, d in GAUGES.items()
        }
        self.accepted_per_pos = metrics.Counter(
            "longspark_spec_decode_num_accepted_tokens_per_pos",
            "accepted draft tokens by position in the block",
            tag_keys=("model_name", "position"),
        )
        self.ttft = metrics.Histogram(
            "longspark_time_to_first_token_seconds", "TTFT", LATENCY_BUCKETS, keys
        )
        self.tpot = metrics.Histogram(
            "longspark_time_per_output_token_seconds", "TPOT", LATENCY_BUCKETS, keys
        )
        self._last: dict[str, Any] = {}

    @staticmethod
    def snapshot(engine: Engine) -> dict[str, Any]:
        """Engine-thread side: the numbers, without Ray calls (runs between rounds)."""
        s, spec = engine.stats, engine.stats.spec
        sched = engine.scheduler
        return {
            "spec_decode_num_drafts": spec.num_drafts,
            "spec_decode_num_draft_tokens": spec.num_draft_tokens,
            "spec_decode_num_accepted_tokens": spec.num_accepted_tokens,
            "generation_tokens": s.num_generated_tokens,
            "rounds": s.rounds,
            "request_success": s.finished,
            "accepted_per_pos": list(spec.accepted_per_pos),
            "num_requests_running": len(sched.running),
            "num_requests_waiting": len(sched.waiting),
            "kv_cache_usage_perc": sched.reserved_tokens / max(1, sched.capacity),
            "spec_decode_mean_accepted_length": spec.mean_accepted_length,
            "round_time_ms": 1e3 * s.round_s / max(1, s.rounds),
            "draft_time_ms": 1e3 * s.draft_s / max(1, s.rounds),
            "verify_time_ms": 1e3 * s.verify_s / max(1, s.rounds),
        }

    def update(self, snap: dict[str, Any]) -> None:
        for name, counter in self.counters.items():
            delta = snap[name] - self._last.get(name, 0)
            if delta > 0:
                counter.inc(delta, self.tags)
        last_pos = self._last.get("accepted_per_pos", [])
        for pos, count in enumerate(snap["accepted_per_pos"]):
            delta = count - (last_pos[pos] if pos < len(last_pos) else 0)
            if delta > 0:
                self.accepted_per_pos.inc(delta, {**self.tags, "position": str(pos)})
        for name, gauge in self.gauges.items():
            gauge.set(float(snap[name]), self.tags)
        self._last = snap

    def observe_request(self, ttft_s: float | None, tpot_s: float | None) -> None:
        if ttft_s is not None:
            self.ttft.observe(ttft_s, self.tags)
        if tpot_s is not None:
            self.tpot.observe(tpot_s, self.tags)
