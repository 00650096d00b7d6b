"""Plain decoding speed at C=1: our target engine vs transformers' ``generate``, same run.

Both decode the same chat prompt greedily for exactly ``max_tokens`` tokens (EOS ignored);
each variant is repeated and the median is reported, with the ratio to transformers'
median from the same run. Variants: ours fp32 (the exactness reference), ours bf16, ours
with int4 weights, transformers fp32 (and transformers bf16 when ``--dtype bfloat16`` is asked).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Any

import torch

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _time_ours(
    path: str, dtype: str, ids: list[int], n: int, repeats: int, quant: str = "none"
) -> dict[str, Any]:
    from services.engine.core import Engine
    from services.engine.params import SamplingParams
    from services.engine.tokenizer import Tokenizer
    from target_actor.runner import TargetSpec
    from target_actor.worker import LocalTarget

    engine = Engine(LocalTarget(TargetSpec(path, dtype=dtype, quant=quant)), Tokenizer(path))
    engine.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    rates, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        (out,) = engine.generate([ids], SamplingParams(max_tokens=n, ignore_eos=True))
        rates.append(len(out.token_ids) / (time.perf_counter() - t0))
    return {"tokens_per_s": rates, "token_ids": out.token_ids}


def _time_hf(path: str, dtype: torch.dtype, ids: list[int], n: int, repeats: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    inp = torch.tensor([ids])
    kw = dict(do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    with torch.inference_mode():
        model.generate(inp, **{**kw, "max_new_tokens": 8, "min_new_tokens": 8})  # warm-up
        rates, out = [], None
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = model.generate(inp, **kw)
            rates.append(n / (time.perf_counter() - t0))
    return {"tokens_per_s": rates, "token_ids": out[0, len(ids) :].tolist()}


def run_decode_bench(args: argparse.Namespace) -> dict[str, Any]:
    from services.engine.tokenizer import Tokenizer
    from target_actor.checkpoint import resolve_target

    path = str(resolve_target(args.target))
    ids = Tokenizer(path).encode_chat([{"role": "user", "content": PROMPT}])
    n, reps = args.max_tokens, args.repeats
    results = {
        "transformers_fp32": _time_hf(path, torch.float32, ids, n, reps),
        "longspark_fp32": _time_ours(path, "float32", ids, n, reps),
        "longspark_bf16": _time_ours(path, "bfloat16", ids, n, reps),
        "longspark_int4": _time_ours(path, "float32", ids, n, reps, quant="int4"),
    }
    if args.dtype in ("bfloat16", "bf16"):
        results["transformers_bf16"] = _time_hf(path, torch.bfloat16, ids, n, reps)
    ref = statistics.median(results["transformers_fp32"]["tokens_per_s"])
    summary = {}
    for name, r in results.items():
        med = statistics.median(r["tokens_per_s"])
        summary[name] = {
            "median_tokens_per_s": round(med, 2),
            "ratio_vs_transformers_fp32": round(med / ref, 3),
            "runs": [round(x, 2) for x in r["tokens_per_s"]],
        }
    same = results["longspark_fp32"]["token_ids"] == results["transformers_fp32"]["token_ids"]
    return {
        "benchmark": "plain decode, C=1",
        "model": path.rsplit("/", 1)[-1],
        "prompt_tokens": len(ids),
        "max_tokens": n,
        "repeats": reps,
        "threads": torch.get_num_threads(),
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
        "greedy_tokens_identical_fp32": same,
        "results": summary,
    }
