"""Plain (autoregressive) decoding of one request through a target: the baseline mode."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from target_actor.batch import ForwardBatch
from target_actor.config import TargetConfigError

from .sampling import SamplingParams, sample_next
from .stopping import StopChecker
from .tokenizer import Tokenizer


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated tokens only
    num_prompt_tokens: int
    num_generated_tokens: int
    finish_reason: str
    mode: str
    elapsed_s: float
    tokens_per_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(out.pop("extra"))
        return out


def check_prompt(prompt_ids: list[int], max_len: int) -> None:
    if not prompt_ids:
        raise TargetConfigError("the prompt is empty")
    if len(prompt_ids) >= max_len:
        raise TargetConfigError(
            f"the prompt has {len(prompt_ids)} tokens; the model's context is {max_len} tokens"
        )


def generate_plain(
    target, tok: Tokenizer, prompt_ids: list[int], params: SamplingParams, seq_id: int = 0
) -> GenerationResult:
    """Prefill, then one target forward per token until a stop condition."""
    cfg = target.cfg
    max_len = cfg.max_position_embeddings
    check_prompt(prompt_ids, max_len)
    eos = cfg.eos_token_ids or ((tok.eos_token_id,) if tok.eos_token_id is not None else ())
    stopper = StopChecker(
        tok.decode, eos, params.max_tokens, params.stop, params.ignore_eos, max_len
    )
    gen = params.generator()
    t0 = time.perf_counter()
    try:
        logits = target.forward(ForwardBatch.single(seq_id, prompt_ids, 0)).logits[-1]
        generated: list[int] = []
        pos = len(prompt_ids)
        while True:
            generated.append(sample_next(logits, params, gen))
            reason, keep = stopper.check(generated, pos + 1)
            if reason is not None:
                break
            logits = target.forward(ForwardBatch.single(seq_id, generated[-1:], pos)).logits[-1]
            pos += 1
    finally:
        target.free([seq_id])
    elapsed = time.perf_counter() - t0
    generated = generated[:keep]
    text = tok.decode(generated)
    if stopper.stop_at is not None:
        text = text[: stopper.stop_at]
    return GenerationResult(
        text=text,
        token_ids=generated,
        num_prompt_tokens=len(prompt_ids),
        num_generated_tokens=len(generated),
        finish_reason=reason,
        mode="ar",
        elapsed_s=elapsed,
        tokens_per_s=len(generated) / elapsed if elapsed > 0 else 0.0,
    )
