"""Prometheus metrics of an engine replica, exported through Ray's metrics agent.

Names follow vLLM's. Ray 2.60 warns that ``:`` in a metric name "is no longer allowed",
so each metric is created as ``longspark_<name>`` and Ray's agent exports it as
``ray_longspark_<name>`` (counters with Prometheus' ``_total`` suffix, histograms as
``_bucket`` / ``_sum`` / ``_count``). ``deploy/prometheus.yml`` renames them to vLLM's
spelling on ingestion (``ray_longspark_spec_decode_num_drafts_total`` ->
``longspark:spec_decode_num_drafts_total``); the Grafana dashboard reads those names.

Counters are exported as increments of the engine's cumulative ``EngineStats``; a
snapshot is taken on the engine thread (between rounds, draining the per-round and
per-request timing logs), the export happens on the replica's event loop. Note that
Ray's agent computes a histogram's ``_sum`` from bucket midpoints, so a mean from
``_sum / _count`` is approximate; quantiles come from the buckets either way.
"""

from __future__ import annotations

import bisect
from typing import Any

from ray.util import metrics

from services.engine.core import Engine

PREFIX = "longspark_"
LATENCY_BUCKETS = [
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
    10.0, 30.0, 60.0, 120.0,
]  # fmt: skip

COUNTERS = {
    "spec_decode_num_drafts": "rounds that verified at least one draft token",
    "spec_decode_num_draft_tokens": "draft tokens verified",
    "spec_decode_num_accepted_tokens": "draft tokens accepted",
    "generation_tokens": "tokens committed by engine rounds (a request's first token, "
    "sampled at prefill, is not counted here)",
    "prompt_tokens": "prompt tokens of finished requests",
    "output_tokens": "tokens returned to clients, counted when each request finishes",
    "rounds": "engine rounds",
    "drafter_fallbacks": "rounds verified without a proposal (drafter failed or timed out)",
    "drafter_failures": "drafter actor failures",
    "drafter_restarts": "drafter actors restarted",
    "drafter_lost_sequences": "sequences that went on plainly after a drafter failure",
    "isolated_failures": "requests that failed alone in a round or prefill (the rest went on)",
    "split_rounds": "failed verifies or prefills retried in halves to find the failing requests",
    "num_preemptions": "sequences preempted for KV room (their KV recomputed later)",
}
LABELLED_COUNTERS = {  # name -> (description, extra tag key)
    "spec_decode_num_accepted_tokens_per_pos": (
        "accepted draft tokens by position in the block",
        "position",
    ),
    "request_success": ("requests finished, by finish reason", "finished_reason"),
}
GAUGES = {
    "num_requests_running": "sequences in the running batch",
    "num_requests_waiting": "requests waiting for admission",
    "kv_cache_usage_perc": "fraction of the KV-cache blocks granted to running sequences (0..1)",
    "spec_decode_mean_accepted_length": "tokens committed per drafting round (tau), since start",
    "round_time_ms": "mean round time (draft + verify + commit), since start",
    "draft_time_ms": "mean drafting time per round, since start",
    "verify_time_ms": "mean verification time per round, since start",
    "drafter_enabled": "1 while the replica drafts, 0 when plain or the drafter is down",
}
HISTOGRAMS = {
    "time_to_first_token_seconds": "TTFT, from the replica receiving the request",
    "time_per_output_token_seconds": "TPOT: (last token - first token) / (tokens - 1)",
    "e2e_request_latency_seconds": "engine admission to last token (aborts excluded)",
    "round_time_seconds": "one engine round: draft + verify + commit",
    "draft_time_seconds": "drafting part of a round",
    "verify_time_seconds": "verification part of a round",
}
DRAFTER_COUNTERS = tuple(n for n in COUNTERS if n.startswith("drafter_"))  # ResilientDrafter's


def series_names(prefix: str = "ray_" + PREFIX) -> set[str]:
    """Every sample name this module exports, as Prometheus sees it under ``prefix``."""
    names = {f"{prefix}{n}_total" for n in (*COUNTERS, *LABELLED_COUNTERS)}
    names |= {f"{prefix}{n}" for n in GAUGES}
    names |= {f"{prefix}{n}{s}" for n in HISTOGRAMS for s in ("_bucket", "_sum", "_count")}
    return names


class EngineMetrics:
    def __init__(self, model_name: str) -> None:
        self.tags = {"model_name": model_name}
        keys = ("model_name",)
        self.counters = {
            n: metrics.Counter(PREFIX + n, d, tag_keys=keys) for n, d in COUNTERS.items()
        }
        self.labelled = {
            n: metrics.Counter(PREFIX + n, d, tag_keys=(*keys, label))
            for n, (d, label) in LABELLED_COUNTERS.items()
        }
        self.gauges = {n: metrics.Gauge(PREFIX + n, d, tag_keys=keys) for n, d in GAUGES.items()}
        self.histograms = {
            n: metrics.Histogram(PREFIX + n, d, LATENCY_BUCKETS, keys)
            for n, d in HISTOGRAMS.items()
        }
        self._last: dict[str, Any] = {}
        self.local = {
            n: LocalHistogram(LATENCY_BUCKETS)
            for n in (
                "time_to_first_token_seconds",
                "time_per_output_token_seconds",
                "e2e_request_latency_seconds",
            )
        }

    @staticmethod
    def snapshot(engine: Engine, drain: bool = True) -> dict[str, Any]:
        """Engine-thread side: the numbers, without Ray calls (runs between rounds);
        ``drain`` takes the timing logs (the exporter's), else leaves them."""
        s, spec = engine.stats, engine.stats.spec
        sched = engine.scheduler
        counters = getattr(engine.drafter, "counters", None)
        drafter = counters() if callable(counters) else {}
        return {
            "spec_decode_num_drafts": spec.num_drafts,
            "spec_decode_num_draft_tokens": spec.num_draft_tokens,
            "spec_decode_num_accepted_tokens": spec.num_accepted_tokens,
            "generation_tokens": s.num_generated_tokens,
            "prompt_tokens": s.num_prompt_tokens,
            "output_tokens": s.num_output_tokens,
            "rounds": s.rounds,
            "isolated_failures": s.isolated_failures,
            "split_rounds": s.split_rounds,
            "num_preemptions": s.preemptions,
            **{n: int(drafter.get(n, 0)) for n in DRAFTER_COUNTERS},
            "spec_decode_num_accepted_tokens_per_pos": {
                str(pos): n for pos, n in enumerate(spec.accepted_per_pos)
            },
            "request_success": dict(s.finish_reasons),
            "num_requests_running": len(sched.running),
            "num_requests_waiting": len(sched.waiting),
            "kv_cache_usage_perc": sched.reserved_tokens / max(1, sched.capacity),
            "spec_decode_mean_accepted_length": spec.mean_accepted_length,
            "round_time_ms": 1e3 * s.round_s / max(1, s.rounds),
            "draft_time_ms": 1e3 * s.draft_s / max(1, s.rounds),
            "verify_time_ms": 1e3 * s.verify_s / max(1, s.rounds),
            "drafter_enabled": float(
                engine.drafter is not None and bool(drafter.get("drafter_enabled", True))
            ),
            "rounds_log": s.round_log.drain() if drain else [],
            "requests_log": s.request_log.drain() if drain else [],
        }

    def update(self, snap: dict[str, Any]) -> None:
        for name, counter in self.counters.items():
            delta = snap[name] - self._last.get(name, 0)
            if delta > 0:
                counter.inc(delta, self.tags)
        for name, counter in self.labelled.items():
            label = LABELLED_COUNTERS[name][1]
            last = self._last.get(name, {})
            for value, count in snap[name].items():
                delta = count - last.get(value, 0)
                if delta > 0:
                    counter.inc(delta, {**self.tags, label: value})
        for name, gauge in self.gauges.items():
            gauge.set(float(snap[name]), self.tags)
        h = self.histograms
        for draft_s, verify_s, round_s in snap["rounds_log"]:
            h["draft_time_seconds"].observe(draft_s, self.tags)
            h["verify_time_seconds"].observe(verify_s, self.tags)
            h["round_time_seconds"].observe(round_s, self.tags)
        for (e2e_s,) in snap["requests_log"]:
            h["e2e_request_latency_seconds"].observe(e2e_s, self.tags)
            self.local["e2e_request_latency_seconds"].observe(e2e_s)
        self._last = snap

    def observe_request(self, ttft_s: float | None, tpot_s: float | None) -> None:
        if ttft_s is not None:
            self.histograms["time_to_first_token_seconds"].observe(ttft_s, self.tags)
            self.local["time_to_first_token_seconds"].observe(ttft_s)
        if tpot_s is not None:
            self.histograms["time_per_output_token_seconds"].observe(tpot_s, self.tags)
            self.local["time_per_output_token_seconds"].observe(tpot_s)

    def prometheus_text(self, snap: dict[str, Any]) -> str:
        """The replica's metrics in Prometheus' text format, for ``/metrics`` on the API
        port: ``snap`` (a fresh, non-draining snapshot) for counters and gauges, this
        replica's own TTFT / TPOT / e2e histograms. Names in vLLM's spelling
        (:func:`exposed_name`)."""
        lines: list[str] = []
        tags = _labels(self.tags)

        def family(name: str, kind: str, help_text: str) -> str:
            full = exposed_name(name)
            lines.append(f"# HELP {full} {help_text}")
            lines.append(f"# TYPE {full} {kind}")
            return full

        for name, help_text in COUNTERS.items():
            full = family(name, "counter", help_text)
            lines.append(f"{full}_total{tags} {snap[name]}")
        for name, (help_text, label) in LABELLED_COUNTERS.items():
            full = family(name, "counter", help_text)
            for value, count in sorted(snap[name].items()):
                lines.append(f"{full}_total{_labels({**self.tags, label: value})} {count}")
        for name, help_text in GAUGES.items():
            full = family(name, "gauge", help_text)
            lines.append(f"{full}{tags} {float(snap[name])}")
        for name, hist in self.local.items():
            full = family(name, "histogram", HISTOGRAMS[name])
            for le, count in hist.cumulative():
                lines.append(f"{full}_bucket{_labels({**self.tags, 'le': le})} {count}")
            lines.append(f"{full}_sum{tags} {hist.sum}")
            lines.append(f"{full}_count{tags} {hist.count}")
        return "\n".join(lines) + "\n"


# the names vLLM's server exports (as vllm:<name>); the rest are ours (longspark:<name>)
VLLM_NAMES = frozenset(
    {
        "num_requests_running",
        "num_requests_waiting",
        "num_preemptions",
        "kv_cache_usage_perc",
        "prompt_tokens",
        "generation_tokens",
        "request_success",
        "spec_decode_num_drafts",
        "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens",
        "spec_decode_num_accepted_tokens_per_pos",
        "time_to_first_token_seconds",
        "time_per_output_token_seconds",
        "e2e_request_latency_seconds",
    }
)


def exposed_name(name: str) -> str:
    """A metric's name on the API port's ``/metrics``: ``vllm:`` where vLLM's server has
    the same series, ``longspark:`` otherwise."""
    return ("vllm:" if name in VLLM_NAMES else "longspark:") + name


def _labels(tags: dict[str, str]) -> str:
    body = ",".join(f'{k}="{_escape(str(v))}"' for k, v in tags.items())
    return "{" + body + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class LocalHistogram:
    """Bucket counts kept in the replica, for its own ``/metrics``."""

    def __init__(self, buckets: list[float]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for le, n in zip([*map(str, self.buckets), "+Inf"], self.counts, strict=True):
            total += n
            out.append((le, total))
        return out
