"""Offline generation of one request through the engine, with the CLI's JSON contract."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from .engine import Engine
from .sampling import SamplingParams


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated tokens only
    num_prompt_tokens: int
    num_generated_tokens: int
    finish_reason: str
    mode: str  # "ar" | "spec"
    elapsed_s: float
    tokens_per_s: float
    rounds: int = 0
    mean_accepted_length: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(out.pop("extra"))
        return out


def generate_one(engine: Engine, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
    t0 = time.perf_counter()
    out = engine.generate([prompt_ids], params)[0]
    elapsed = time.perf_counter() - t0
    n = len(out.token_ids)
    return GenerationResult(
        text=out.text,
        token_ids=out.token_ids,
        num_prompt_tokens=out.num_prompt_tokens,
        num_generated_tokens=n,
        finish_reason=out.finish_reason,
        mode=engine.mode,
        elapsed_s=elapsed,
        tokens_per_s=n / elapsed if elapsed > 0 else 0.0,
        rounds=out.stats.rounds,
        mean_accepted_length=round(out.stats.mean_accepted_length, 3),
    )
