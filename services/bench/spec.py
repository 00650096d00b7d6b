"""Speculative vs plain decoding through the same engine, same prompts, same run.

At each concurrency ``C`` every mode decodes the same prompts greedily with at most ``C``
running at once (continuous batching, in-process engine, no HTTP) for ``max_tokens``
tokens. Modes: plain, spec with a fixed ``k`` every round, and spec with the adaptive
per-round ``k`` (``services.engine.adaptive.policy``). We report output tokens/s (total tokens /
total time), the ratios to plain, tau, per-round draft/verify times, and whether every
mode produced the plain tokens.

With ``repeats > 1`` the modes run interleaved (plain, fixed, adaptive, plain, ...), each
ratio is taken within one repeat, and the report gives the median ratio and every
repeat's: on a shared CPU host two runs of one C = 32 configuration differed by up to
0.24x, so one run's ratio says little there. Each mode's details are those of its
median-speed repeat.
"""

from __future__ import annotations

import platform
import statistics
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
    from services.engine.backends import build_engine
    from services.engine.params import SamplingParams

    engine, close = build_engine(opts.model_copy(update={"max_num_seqs": concurrency}))
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
    repeats: int = 1,
) -> dict[str, Any]:
    from services.engine.backends import EngineOptions

    base = EngineOptions(target=target, mode="spec", drafter=drafter, k=k, carry=carry)
    modes = {
        "plain": base.model_copy(update={"mode": "ar"}),
        "spec_fixed_k": base.model_copy(update={"adaptive": False}),
        "spec_adaptive": base,
    }
    runs = []
    for c in concurrency:
        chosen = prompts or _prompts_for(c)
        rounds = [
            {name: _run_mode(o, chosen, max_tokens, c) for name, o in modes.items()}
            for _ in range(repeats)
        ]
        token_ids = [r.pop("token_ids") for rnd in rounds for r in rnd.values()]
        same = all(ids == token_ids[0] for ids in token_ids)  # the first is plain's
        runs.append({"concurrency": c, "prompts": len(chosen), "outputs_identical": same})
        for name in ("spec_fixed_k", "spec_adaptive"):
            ratios = [rnd[name]["tokens_per_s"] / rnd["plain"]["tokens_per_s"] for rnd in rounds]
            key = "speedup_" + name.removeprefix("spec_")
            runs[-1][key] = round(statistics.median(ratios), 3)
            if repeats > 1:
                runs[-1][key + "_repeats"] = [round(x, 3) for x in ratios]
        for name in modes:
            by_speed = sorted((rnd[name] for rnd in rounds), key=lambda r: r["tokens_per_s"])
            runs[-1][name] = by_speed[(len(by_speed) - 1) // 2]  # the median (lower) repeat
            if repeats > 1:
                runs[-1][name]["tokens_per_s_repeats"] = [
                    rnd[name]["tokens_per_s"] for rnd in rounds
                ]
    return {
        "benchmark": "spec vs plain, greedy, in-process engine",
        "max_tokens": max_tokens,
        "drafter": drafter or "shipped",
        "k": k,
        "carry": carry,
        "repeats": repeats,
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
        "outputs_identical": all(r["outputs_identical"] for r in runs),
        "runs": runs,
    }


def _prompts_for(concurrency: int) -> list[str]:
    """The six default prompts at C=1; the benchmark mix, two prompts per slot, above."""
    if concurrency == 1:
        return DEFAULT_PROMPTS
    from services.data.prompts import benchmark_mix

    per_category = max(1, -(-2 * concurrency // 6))
    return [p.prompt for p in benchmark_mix(per_category, seed=1)][: 2 * concurrency]
