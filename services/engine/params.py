"""A request's sampling settings, validated once at the boundary.

The distribution they define, ``target_probs``, lives with the verifier on the target
side (``target_actor.sampling``), where both plain steps and rejection sampling use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from target_actor.errors import LongSparkError
from target_actor.sampling import SAMPLING_EPS


class InvalidRequest(LongSparkError, ValueError):
    """A request setting is out of range (one-line message naming the field)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequest(
                f"max_tokens must be a positive integer, got {self.max_tokens}", "max_tokens"
            )
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequest(
                f"temperature must lie in [0, 100], got {self.temperature}", "temperature"
            )
        if self.temperature < SAMPLING_EPS:
            self.temperature = 0.0  # greedy, as vLLM does: logits / T would overflow
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must lie in (0, 1], got {self.top_p}", "top_p")
        if self.top_k == -1:
            self.top_k = 0
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequest(
                f"top_k must be -1, 0 or a positive integer, got {self.top_k}", "top_k"
            )
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequest("stop must be a non-empty string or a list of them", "stop")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self) -> torch.Generator | None:
        """A private RNG for a seeded request, so its output does not depend on the batch."""
        return None if self.seed is None else torch.Generator().manual_seed(self.seed)
