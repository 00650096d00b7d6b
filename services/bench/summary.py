"""One load level's numbers from its request records: throughput, latency percentiles, tau."""

from __future__ import annotations

from typing import Any

import numpy as np

from services.bench.http_load import RequestRecord


def percentiles_ms(values_s: list[float]) -> dict[str, float] | None:
    """Mean, p50 and p99 in milliseconds (numpy's linear interpolation), or None if empty."""
    if not values_s:
        return None
    a = np.asarray(values_s) * 1e3
    return {
        "mean": round(float(a.mean()), 2),
        "p50": round(float(np.percentile(a, 50)), 2),
        "p99": round(float(np.percentile(a, 99)), 2),
    }


def tau(num_drafts: int, num_accepted: int) -> float | None:
    """Mean accepted length: tokens committed per drafting round (None without drafts)."""
    return round(1.0 + num_accepted / num_drafts, 3) if num_drafts else None


def summarize_level(records: list[RequestRecord], wall_s: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    drafts = sum(r.num_drafts for r in ok)
    draft_tokens = sum(r.num_draft_tokens for r in ok)
    accepted = sum(r.num_accepted_tokens for r in ok)
    return {
        "requests": len(records),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "prompt_tokens_mean": round(sum(r.prompt_tokens for r in ok) / max(1, len(ok)), 1),
        "output_tokens": tokens,
        "duration_s": round(wall_s, 3),
        "output_tokens_per_s": round(tokens / wall_s, 2) if wall_s > 0 else None,
        "requests_per_s": round(len(ok) / wall_s, 3) if wall_s > 0 else None,
        "ttft_ms": percentiles_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": percentiles_ms([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_ms": percentiles_ms([x for r in ok for x in r.itl_s]),
        "e2e_ms": percentiles_ms([r.e2e_s for r in ok]),
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "tau": tau(drafts, accepted),
        "acceptance_rate": round(accepted / draft_tokens, 4) if draft_tokens else None,
    }
