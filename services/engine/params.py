"""A request's sampling settings, validated once at the boundary.

The distribution they define, ``target_probs``, lives with the verifier on the target
side (``target_actor.sampling``), where both plain steps and rejection sampling use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from target_actor.batch import SeqSampling
from target_actor.errors import LongSparkError
from target_actor.sampling import SAMPLING_EPS


class InvalidRequest(LongSparkError, ValueError):
    """A request setting is out of range (one-line message naming the field)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


MAX_LOGPROBS = 20  # top log-probabilities per token, at most (OpenAI's and vLLM's limit)
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit bias value


@dataclass
class SamplingParams:
    """What one request asks of the sampler (vLLM's names and meanings).

    The distribution: temperature, ``min_p``, ``top_k``, ``top_p`` of the logits after the
    processors that read the request's own tokens (``presence_penalty``,
    ``frequency_penalty``, ``repetition_penalty``, ``logit_bias``, ``min_tokens``). The
    output: stop strings and ``stop_token_ids``, ``logprobs`` per token (the raw model
    distribution, vLLM's default), how the text is decoded.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # None: none; 0: the chosen token's; N: and the N most likely
    prompt_logprobs: int | None = None  # the same for each prompt token after the first
    grammar: str | None = None  # llguidance grammar (services.engine.structured)
    grammar_field: str = "response_format"  # the request field it came from (errors)
    stream_interval: int | None = None  # stream every N tokens at least (None: the server's)

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
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest(f"min_p must lie in [0, 1], got {self.min_p}", "min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequest(f"{name} must lie in [-2, 2], got {getattr(self, name)}", name)
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise InvalidRequest(
                f"repetition_penalty must lie in (0, 2], got {self.repetition_penalty}",
                "repetition_penalty",
            )
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequest(
                f"min_tokens must lie in [0, max_tokens], got {self.min_tokens}", "min_tokens"
            )
        if self.logit_bias:
            self.logit_bias = {
                int(t): max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, float(b)))
                for t, b in self.logit_bias.items()
            }
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequest("stop_token_ids must be token ids", "stop_token_ids")
        if self.stream_interval is not None and (
            not isinstance(self.stream_interval, int) or self.stream_interval < 1
        ):
            raise InvalidRequest(
                f"stream_interval must be at least 1, got {self.stream_interval}",
                "stream_interval",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidRequest(f"{name} must lie in [0, {MAX_LOGPROBS}], got {value}", name)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self) -> torch.Generator | None:
        """A private RNG for a seeded request, so its output does not depend on the batch."""
        return None if self.seed is None else torch.Generator().manual_seed(self.seed)

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids the request names must exist in the model's vocabulary."""
        for name, ids in (
            ("logit_bias", list(self.logit_bias or ())),
            ("stop_token_ids", self.stop_token_ids),
        ):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequest(
                    f"{name} names token id {bad[0]}, outside the vocabulary of {vocab_size}", name
                )

    def target_sampling(self, eos_ids: tuple[int, ...]) -> SeqSampling:
        """What the target side samples with; ``min_tokens`` holds back EOS (unless
        ignored) and the stop token ids."""
        stop_ids = tuple(
            dict.fromkeys([*(() if self.ignore_eos else eos_ids), *self.stop_token_ids])
        )
        return SeqSampling(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self.logit_bias or None,
            min_tokens=self.min_tokens,
            stop_ids=stop_ids if self.min_tokens else (),
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            grammar=self.grammar,
        )
