"""Mean accepted length (tau) per benchmark category, through the real engine.

Held-out prompts (never in training data) from the six categories, chat template applied,
decoded by the engine in spec mode with the given drafter at each temperature; tau per
category = 1 + accepted draft tokens / drafting rounds, over all its prompts.
"""

from __future__ import annotations

import time
from typing import Any

from .backends import EngineOptions, build_engine
from .prompts import benchmark_mix
from .sampling import SamplingParams


def eval_acceptance(
    drafter: str | None,
    k: int | None = None,
    carry: bool = True,
    per_category: int = 8,
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
            drafts: dict[str, list[int]] = {}
            for prompt, out in zip(prompts, outs, strict=True):
                d = drafts.setdefault(prompt.category, [0, 0])
                d[0] += out.stats.num_drafts
                d[1] += out.stats.num_accepted_tokens
            tau = {c: round(1 + a / n, 3) if n else None for c, (n, a) in drafts.items()}
            total_n = sum(n for n, _ in drafts.values())
            total_a = sum(a for _, a in drafts.values())
            tau["overall"] = round(1 + total_a / total_n, 3) if total_n else None
            report[f"T={temperature:g}"] = {
                "tau": tau,
                "seconds": round(time.perf_counter() - t0, 1),
            }
        return report
    finally:
        close()
