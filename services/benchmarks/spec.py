"""Speculative vs plain decoding through the same engine, same prompts, same run (C=1).

Each mode decodes every prompt greedily (one request at a time) for ``max_tokens``
tokens; we report output tokens/s (total tokens / total time), the spec/plain ratio,
mean accepted length tau, per-round draft/verify times, and whether outputs matched.
"""

from __future__ import annotations

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


def _run_mode(opts, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    from ..backends import build_engine
    from ..sampling import SamplingParams

    engine, close = build_engine(opts)
    try:
        ids = [engine.tok.encode_chat([{"role": "user", "content": p}]) for p in prompts]
        params = SamplingParams(max_tokens=max_tokens)
        engine.generate([ids[0]], SamplingParams(max_tokens=8))  # warm-up
        engine.stats = type(engine.stats)()
        outs, tokens, t0 = [], 0, time.perf_counter()
        for p in ids:
            out = engine.generate([p], params)[0]
            outs.append(out.token_ids)
            tokens += len(out.token_ids)
        elapsed = time.perf_counter() - t0
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
) -> dict[str, Any]:
    from ..backends import EngineOptions

    prompts = prompts or DEFAULT_PROMPTS
    plain = _run_mode(EngineOptions(target=target, mode="ar"), prompts, max_tokens)
    spec = _run_mode(
        EngineOptions(target=target, mode="spec", drafter=drafter, k=k, carry=carry),
        prompts,
        max_tokens,
    )
    same = plain.pop("token_ids") == spec.pop("token_ids")
    return {
        "benchmark": "spec vs plain, C=1, greedy",
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "drafter": drafter or "shipped",
        "k": k,
        "carry": carry,
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
        "outputs_identical": same,
        "speedup": round(spec["tokens_per_s"] / plain["tokens_per_s"], 3),
        "plain": plain,
        "spec": spec,
    }
