"""Drafting time and state size against context length: LongSpark vs the full-prefix baseline.

One sequence, a random drafter on the default target's geometry (SmolLM2-135M: hidden 576,
9 heads, 3 KV heads, head_dim 64, 30 layers, vocab 49152, 4 taps). The views are random
tensors of the right shapes (the target is not run: drafting cost does not depend on the
values). Each timed ``propose()`` call includes applying the previous round's update
(``accepted`` drafts committed, the rest carried over), as in serving. Both drafters share
one network, so the only difference is the context they read.

LongSpark's claim: drafting time at 32K / 1K stays ~1 (goal <= 1.10) while the baseline's
grows; its state is >= 100x smaller than the baseline's at 32K.
"""

from __future__ import annotations

import platform
import statistics
import time
from typing import Any

import torch

GOAL_TIME_RATIO = 1.10
GOAL_STATE_RATIO = 100.0


def _longspark_round(drafter, seq_id: int, length: int, k: int, accepted: int, gen):
    """A ``DraftRequest`` at ``length`` carrying a random update from ``length - accepted - 1``."""
    from target_actor.messages import DraftRequest, RoundUpdate

    cfg = drafter.cfg
    t, L, n = cfg.target, cfg.num_layers, accepted + 1
    update = RoundUpdate(
        seq_id=seq_id,
        length=length,
        committed_k=torch.randn(L, n, t.num_kv_heads, t.head_dim, generator=gen),
        committed_v=torch.randn(L, n, t.num_kv_heads, t.head_dim, generator=gen),
        boundary=torch.randn(L, t.hidden_size, generator=gen),
        rejected=torch.randn(k - accepted, L, t.hidden_size, generator=gen),
    )
    return DraftRequest(seq_id, 1, length, 0.0, update)


def _baseline_round(drafter, seq_id: int, length: int, k: int, accepted: int, gen):
    from drafter_actor.baseline import FullPrefixUpdate
    from target_actor.messages import DraftRequest

    L, d = drafter.cfg.num_layers, drafter.cfg.target.hidden_size
    update = FullPrefixUpdate(
        seq_id=seq_id,
        length=length,
        committed=torch.randn(accepted + 1, L, d, generator=gen),
        rejected=torch.randn(k - accepted, L, d, generator=gen),
    )
    return DraftRequest(seq_id, 1, length, 0.0, update)


def _prefill_longspark(drafter, seq_id: int, t: int, gen) -> None:
    from target_actor.messages import PrefillViews

    cfg = drafter.cfg
    tg, L, w = cfg.target, cfg.num_layers, min(cfg.window, t)
    drafter.prefill(
        [
            PrefillViews(
                seq_id=seq_id,
                length=t,
                window_k=torch.randn(L, w, tg.num_kv_heads, tg.head_dim, generator=gen),
                window_v=torch.randn(L, w, tg.num_kv_heads, tg.head_dim, generator=gen),
                summary_m=torch.randn(
                    L, tg.num_heads, cfg.summary_slots, tg.head_dim, generator=gen
                ),
                summary_lam=torch.randn(L, tg.num_heads, cfg.summary_slots, generator=gen) + 10,
                boundary=torch.randn(L, tg.hidden_size, generator=gen),
            )
        ]
    )


def _prefill_baseline(drafter, seq_id: int, t: int, gen) -> None:
    from drafter_actor.baseline import FullPrefixViews

    L, d = drafter.cfg.num_layers, drafter.cfg.target.hidden_size
    drafter.prefill([FullPrefixViews(seq_id, t, torch.randn(t, L, d, generator=gen))])


def _time(drafter, prefill, make_round, contexts: list[int], k: int, repeats: int) -> dict:
    """One sequence per context; ``repeats`` timed propose() rounds, interleaved across contexts.

    Interleaving (1K, 8K, 32K, 1K, ...) spreads machine noise evenly over the contexts.
    """
    gen = torch.Generator().manual_seed(0)
    accepted = k // 3
    for seq_id, t in enumerate(contexts):
        prefill(drafter, seq_id, t, gen)
    lengths, times = list(contexts), [[] for _ in contexts]
    for i in range(repeats + 1):  # the first round warms up (allocations, RoPE table)
        for seq_id in range(len(contexts)):
            request = make_round(drafter, seq_id, lengths[seq_id] + accepted + 1, k, accepted, gen)
            lengths[seq_id] = request.position
            start = time.perf_counter()
            drafter.propose([request], k)
            if i:
                times[seq_id].append((time.perf_counter() - start) * 1e3)
    out = {}
    for seq_id, t in enumerate(contexts):
        out[str(t)] = {
            "median_ms": round(statistics.median(times[seq_id]), 2),
            "min_ms": round(min(times[seq_id]), 2),
            "runs_ms": [round(x, 2) for x in times[seq_id]],
            "state_bytes": drafter.state_bytes(seq_id),
        }
    drafter.free(list(range(len(contexts))))
    return out


def run_drafter_bench(
    contexts: list[int] | None = None,
    k: int = 15,
    repeats: int = 5,
    *,
    target: str | None = None,
    draft_vocab_size: int | None = None,
    baseline: bool = True,
) -> dict[str, Any]:
    """Time ``propose()`` at each context length for LongSpark and the full-prefix baseline.

    ``contexts`` defaults to 1K, 8K, 32K; ``target`` to the default model (its config and
    embedding are read, it is never run); ``draft_vocab_size`` reduces the LM head.
    """
    from drafter_actor.baseline import FullPrefixDrafter
    from drafter_actor.config import DrafterConfig
    from drafter_actor.drafter import Drafter
    from target_actor.checkpoint import resolve_target
    from target_actor.config import ModelConfig

    contexts = sorted(contexts or [1024, 8192, 32768])
    path = resolve_target(target)
    overrides: dict[str, Any] = {"block_size": max(k, 15)}
    if draft_vocab_size:
        overrides["draft_vocab_size"] = draft_vocab_size
    cfg = DrafterConfig.for_target(ModelConfig.from_pretrained(path), **overrides)
    longspark = Drafter.random(path, cfg, seed=0)
    drafters = {"longspark": (longspark, _prefill_longspark, _longspark_round)}
    if baseline:
        full = FullPrefixDrafter.sharing(longspark)
        drafters["full_prefix"] = (full, _prefill_baseline, _baseline_round)
    with torch.no_grad():
        results = {
            name: _time(drafter, prefill, make_round, contexts, k, repeats)
            for name, (drafter, prefill, make_round) in drafters.items()
        }

    lo, hi = str(contexts[0]), str(contexts[-1])

    def ratio(name: str, key: str) -> float:
        return round(results[name][hi][key] / results[name][lo][key], 3)

    summary: dict[str, Any] = {
        "longspark_time_ratio": ratio("longspark", "median_ms"),
        "longspark_time_ratio_min": ratio("longspark", "min_ms"),
        "longspark_state_ratio": ratio("longspark", "state_bytes"),
    }
    summary["longspark_time_flat"] = summary["longspark_time_ratio"] <= GOAL_TIME_RATIO
    if baseline:
        state_x = (
            results["full_prefix"][hi]["state_bytes"] / results["longspark"][hi]["state_bytes"]
        )
        summary.update(
            full_prefix_time_ratio=ratio("full_prefix", "median_ms"),
            full_prefix_state_ratio=ratio("full_prefix", "state_bytes"),
            state_reduction_at_max_context=round(state_x, 1),
            state_goal_met=state_x >= GOAL_STATE_RATIO,
        )
    return {
        "benchmark": f"drafter propose() at contexts {contexts}, one sequence, k={k}",
        "model": path.name,
        "drafter": {
            "layers": cfg.num_layers,
            "window": cfg.window,
            "summary_slots": cfg.summary_slots,
            "markov_rank": cfg.markov_rank,
            "draft_vocab_size": cfg.draft_vocab_size,
            "parameters": longspark.net.num_parameters(),
        },
        "repeats": repeats,
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
        "ratio_contexts": [int(lo), int(hi)],
        "goals": {"time_ratio_max": GOAL_TIME_RATIO, "state_ratio_min": GOAL_STATE_RATIO},
        "summary": summary,
        "results": results,
    }
