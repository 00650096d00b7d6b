"""Speculative vs plain decoding through the same engine, same prompts, same run.

At each concurrency ``C`` every mode decodes the same prompts greedily with at most ``C``
running at once (continuous batching, in-process engine, no HTTP) for ``max_tokens``
tokens. Modes: plain, spec with a fixed ``k`` every round, and spec with the adaptive
per-round ``k`` (``services.spec_policy``). We report output tokens/s (total tokens /
total time), the ratios to plain, tau, per-round draft/verify times, and whether every
mode produced the plain tokens.
"""

from __future__ import annotations

import dataclasses
import platform
import time
from typing import Any

import torch

DEFAULT_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Tom has 3 apples and buys 5 more. He gives 2 away. How many apples does he have?",
    "Tell me a short story about a robot who learns to paint.",
    "What is the capital of Australia?",
    "Summarize in one sentence: The city council voted to expand the bike lane network "
    "by 40 kilometres over the next three years, citing rising cycling numbers.",
    "Translate to French: The weather is beautiful today.",
]


def _run_mode(opts, prompts: list[str], max_tokens: int, concurrency: int) -> dict[str, Any]:
    from ..backends import build_engine
    from ..sampling import SamplingParams

    engine, close = build_engine(dataclasses.replace(opts, max_num_seqs=concurrency))
    try:
        ids = [engine.tok.encode_chat([{"role": "user", "content": p}]) for p in prompts]
        params = SamplingParams(max_tokens=max_tokens)
        engine.generate(ids[:concurrency], SamplingParams(max_tokens=8))  # warm-up
        engine.stats = type(engine.stats)()
        t0 = time.perf_counter()
        outs = [o.token_ids for o in engine.generate(ids, params)]
        elapsed = time.perf_counter() - t0
        tokens = sum(len(o) for o in outs)
        return {
            "tokens": tokens,
            "elapsed_s": round(elapsed, 3),
            "tokens_per_s": round(tokens / elapsed, 2),
            "token_ids": outs,
            **engine.stats.summary(),
        }
    finally:
        close()


def run_spec_bench(
    drafter: str | None,
    k: int | None,
    max_tokens: int = 128,
    target: str | None = None,
    carry: bool = True,
    prompts: list[str] | None = None,
    concurrency: tuple[int, ...] = (1,),
) -> dict[str, Any]:
    from ..backends import EngineOptions

    base = EngineOptions(target=target, mode="spec", drafter=drafter, k=k, carry=carry)
    modes = {
        "plain": dataclasses.replace(base, mode="ar"),
        "spec_fixed_k": dataclasses.replace(base, adaptive=False),
        "spec_adaptive": base,
    }
    runs = []
    for c in concurrency:
        chosen = prompts or _prompts_for(c)
        results = {name: _run_mode(o, chosen, max_tokens, c) for name, o in modes.items()}
        token_ids = {name: r.pop("token_ids") for name, r in results.items()}
        same = all(ids == token_ids["plain"] for ids in token_ids.values())
        plain_tps = results["plain"]["tokens_per_s"]
        runs.append(
            {
                "concurrency": c,
                "prompts": len(chosen),
                "outputs_identical": same,
                "speedup_fixed_k": round(results["spec_fixed_k"]["tokens_per_s"] / plain_tps, 3),
                "speedup_adaptive": round(results["spec_adaptive"]["tokens_per_s"] / plain_tps, 3),
                **results,
            }
        )
    return {
        "benchmark": "spec vs plain, greedy, in-process engine",
        "max_tokens": max_tokens,
        "drafter": drafter or "shipped",
        "k": k,
        "carry": carry,
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
        "outputs_identical": all(r["outputs_identical"] for r in runs),
        "runs": runs,
    }


def _prompts_for(concurrency: int) -> list[str]:
    """The six default prompts at C=1; the benchmark mix, two prompts per slot, above."""
    if concurrency == 1:
        return DEFAULT_PROMPTS
    from ..prompts import benchmark_mix

    per_category = max(1, -(-2 * concurrency // 6))
    return [p.prompt for p in benchmark_mix(per_category, seed=1)][: 2 * concurrency]
