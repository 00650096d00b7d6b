"""Mean accepted length (tau) per benchmark category, through the real engine.

Held-out prompts (never in training data) from the six categories, chat template applied,
decoded by the engine in spec mode with the given drafter at each temperature; tau per
category = 1 + accepted draft tokens / drafting rounds, over all its prompts.

Prompts differ far more than rounds do (a translation that repeats its source accepts
whole blocks, a one-line answer almost nothing), so each tau comes with its standard
error over prompts (``se``): the ratio estimator's delta-method error, treating each
prompt's (rounds, accepted) as one draw.
"""

from __future__ import annotations

import math
import time
from typing import Any

from services.data.prompts import benchmark_mix
from services.engine.backends import EngineOptions, build_engine
from services.engine.params import SamplingParams


def eval_acceptance(
    drafter: str | None,
    k: int | None = None,
    carry: bool = True,
    per_category: int = 24,
    max_tokens: int = 128,
    temperatures: tuple[float, ...] = (0.0, 1.0),
    batch_size: int = 8,
    seed: int = 0,
    target: str | None = None,
    context_copy: bool = True,
) -> dict[str, Any]:
    engine, close = build_engine(
        EngineOptions(
            target=target,
            mode="spec",
            drafter=drafter,
            k=k,
            adaptive=False,  # tau at a fixed k: every round drafts
            carry=carry,
            context_copy=context_copy,
            max_num_seqs=batch_size,
        )
    )
    try:
        prompts = benchmark_mix(per_category, seed)
        ids = [engine.tok.encode_chat([{"role": "user", "content": p.prompt}]) for p in prompts]
        cfg = engine.drafter.cfg
        report: dict[str, Any] = {
            "drafter": engine.config.drafter_name,
            "k": engine.config.k,
            # the flags in effect: True arguments keep the checkpoint's own flags
            "carry": bool(cfg.carry),
            "context_copy": bool(cfg.context_copy),
            "per_category": per_category,
            "max_tokens": max_tokens,
        }
        for temperature in temperatures:
            t0 = time.perf_counter()
            params = [
                SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i)
                for i in range(len(ids))
            ]
            outs = engine.generate(ids, params)
            rounds: dict[str, list[tuple[int, int]]] = {}  # (rounds, accepted) per prompt
            for prompt, out in zip(prompts, outs, strict=True):
                pair = (out.stats.num_drafts, out.stats.num_accepted_tokens)
                rounds.setdefault(prompt.category, []).append(pair)
            rounds["overall"] = [pair for pairs in rounds.values() for pair in pairs]
            taus = {c: tau_of(pairs) for c, pairs in rounds.items()}
            report[f"T={temperature:g}"] = {
                "tau": {c: tau for c, (tau, _) in taus.items()},
                "se": {c: se for c, (_, se) in taus.items()},
                "seconds": round(time.perf_counter() - t0, 1),
            }
        return report
    finally:
        close()


def tau_of(pairs: list[tuple[int, int]]) -> tuple[float | None, float | None]:
    """tau = 1 + sum(accepted) / sum(rounds) over prompts' ``(rounds, accepted)``, and its
    standard error over prompts (None for no rounds; 0 for a single prompt)."""
    total_n = sum(n for n, _ in pairs)
    if not total_n:
        return None, None
    r = sum(a for _, a in pairs) / total_n
    m = len(pairs)
    if m < 2:
        return round(1 + r, 3), 0.0
    var = sum((a - r * n) ** 2 for n, a in pairs) / (m - 1) * m
    return round(1 + r, 3), round(math.sqrt(var) / total_n, 3)
