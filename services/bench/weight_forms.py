"""``longspark bench forms``: each weight form's speed and its closeness to fp32.

For every form (dtype x quant) the same prompts of the benchmark mix are decoded greedily
(plain decoding, in process) and compared token by token with the fp32 reference:
``agreement`` is the mean fraction of each reply that matches the reference before the
first differing token, ``exact`` the share of replies that match whole. A greedy reply of a
small model drifts for good after its first differing token, so the form is also read on
the reference's own replies, teacher-forced (llama.cpp's ``perplexity --kl-divergence``
measures quantisations so): at each reply position, the KL divergence of the form's
next-token distribution from the reference's (mean and 99th percentile) and whether both
put the same token first. The step times are forwards of the target alone at the row
counts a round has (1 row, a k=7 verify of 8 rows, 8 and 32 decode rows) at a context of
256 tokens.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from services.bench.machine import machine_info
from services.data.prompts import benchmark_mix
from services.engine.core import Engine
from services.engine.params import SamplingParams
from services.engine.tokenizer import Tokenizer
from target_actor.batch import ForwardBatch
from target_actor.checkpoint import resolve_target
from target_actor.runner import TargetRunner, TargetSpec
from target_actor.worker import LocalTarget

FORMS = (
    ("float32", "none"),
    ("bfloat16", "none"),
    ("float32", "int8"),
    ("float32", "int4"),
    ("bfloat16", "int4"),
    ("float32", "int8-q8"),  # opt-in: llama.cpp's one int8 activation plane
    ("float32", "int4-q8"),
)
SHAPES = ((1, 1), (1, 8), (8, 1), (32, 1))  # (sequences, rows each)
CONTEXT = 256


def _step_ms(runner: TargetRunner, seqs: int, rows: int, repeats: int = 5) -> float:
    gen = torch.Generator().manual_seed(0)
    for s in range(seqs):
        ids = torch.randint(0, runner.cfg.vocab_size, (CONTEXT,), generator=gen)
        runner.forward(ForwardBatch([s], ids, [CONTEXT], [0], [1]))
    ids = torch.randint(0, runner.cfg.vocab_size, (seqs * rows,), generator=gen)
    batch = ForwardBatch(list(range(seqs)), ids, [rows] * seqs, [CONTEXT] * seqs, [rows] * seqs)
    runner.forward(batch)
    t0 = time.perf_counter()
    for _ in range(repeats):
        runner.forward(batch)
    runner.free(list(range(seqs)))
    return 1e3 * (time.perf_counter() - t0) / repeats


def _agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[float, float]:
    fractions, exact = [], 0
    for a, b in zip(ref, got, strict=True):
        n = next(
            (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
        )
        exact += a == b
        fractions.append(n / max(1, len(a)))
    return sum(fractions) / len(fractions), exact / len(ref)


def _reply_logprobs(
    runner: TargetRunner, prompts: list[list[int]], replies: list[list[int]]
) -> list[torch.Tensor]:
    """Per prompt, the log-probabilities ``[len(reply), vocab]`` the runner gives each reply
    token's position with the prompt and the reply before it as context (one prefill)."""
    out = []
    for prompt, reply in zip(prompts, replies, strict=True):
        ids = prompt + reply[:-1]
        batch = ForwardBatch.single(0, ids, 0, num_logits=len(reply))
        out.append(torch.log_softmax(runner.forward(batch).logits.float(), -1))
        runner.free([0])
    return out


def _divergence(ref: list[torch.Tensor], got: list[torch.Tensor]) -> dict[str, float]:
    """KL(reference || form) per position (mean, 99th percentile) and the share of positions
    whose most likely token is the same."""
    kl = torch.cat(
        [(r.exp() * (r - g)).sum(-1).clamp_min(0) for r, g in zip(ref, got, strict=True)]
    )
    same = torch.cat([r.argmax(-1) == g.argmax(-1) for r, g in zip(ref, got, strict=True)])
    return {
        "kl_mean": round(kl.mean().item(), 6),
        "kl_p99": round(kl.quantile(0.99).item(), 6),
        "same_top1": round(same.float().mean().item(), 4),
    }


def run_forms_bench(
    target: str | None, per_category: int, max_tokens: int, forms=FORMS
) -> dict[str, Any]:
    path = resolve_target(target)
    tok = Tokenizer(path)
    prompts = [
        tok.encode_chat([{"role": "user", "content": p.prompt}])
        for p in benchmark_mix(per_category, 0)
    ]
    params = SamplingParams(max_tokens=max_tokens)
    rows, reference, ref_logprobs = [], None, None
    for dtype, quant in forms:
        target_ = LocalTarget(TargetSpec(str(path), dtype=dtype, quant=quant))
        runner = target_.runner
        replies = [o.token_ids for o in Engine(target_, tok).generate(prompts, params)]
        reference = reference or replies
        agree, exact = _agreement(reference, replies)
        logprobs = _reply_logprobs(runner, prompts, reference)
        ref_logprobs = ref_logprobs or logprobs
        weight_mb = (
            sum(
                lin.nbytes
                for layer in runner.model.layers
                for lin in (layer.lin_qkv, layer.lin_o, layer.lin_gate_up, layer.lin_down)
            )
            + runner.model.lin_head.nbytes
        )
        row = {
            "dtype": dtype,
            "quant": quant,
            "gemm_weight_mb": round(weight_mb / 2**20, 1),
            "greedy_agreement": round(agree, 4),
            "exact_replies": round(exact, 4),
            **_divergence(ref_logprobs, logprobs),
            "step_ms": {f"{s}x{r}": round(_step_ms(runner, s, r), 2) for s, r in SHAPES},
        }
        row["verify8_over_step1"] = round(row["step_ms"]["1x8"] / row["step_ms"]["1x1"], 2)
        print(row, flush=True)
        rows.append(row)
    return {
        "benchmark": "weight_forms",
        "target": path.name,
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "context_for_steps": CONTEXT,
        "machine": machine_info(),
        "forms": rows,
    }
