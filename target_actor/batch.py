"""What one target forward takes and returns (the messages between engine and ranks)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """A ragged batch: each sequence brings ``num_new[i]`` tokens starting at ``start_pos[i]``.

    ``start_pos[i]`` is also the length the sequence's KV cache is rolled back to before
    the forward (so a verify round's rejected rows vanish without a call of their own);
    a sequence the cache has not seen is created (``start_pos`` must then be 0).
    ``capacity[i]``, when given, is the rows the engine's scheduler granted the sequence:
    its cache is allocated to exactly that (None: the cache grows on its own).
    """

    seq_ids: list[int]
    token_ids: torch.Tensor  # [T] int64, the sequences' new tokens concatenated
    num_new: list[int]  # per sequence, sums to T
    start_pos: list[int]  # per sequence, position of its first new token
    num_logits: list[int]  # per sequence: logits for its last num_logits[i] new tokens
    return_taps: bool = False
    capacity: list[int] | None = None

    def __post_init__(self) -> None:
        n = len(self.seq_ids)
        if not (len(self.num_new) == len(self.start_pos) == len(self.num_logits) == n):
            raise ValueError("seq_ids, num_new, start_pos and num_logits must have one entry each")
        if sum(self.num_new) != self.token_ids.numel():
            raise ValueError(
                f"num_new sums to {sum(self.num_new)}, got {self.token_ids.numel()} tokens"
            )
        if any(not 0 <= m <= k for m, k in zip(self.num_logits, self.num_new, strict=True)):
            raise ValueError("num_logits[i] must lie in 0..num_new[i]")
        if len(set(self.seq_ids)) != n:
            raise ValueError("a sequence may appear only once per batch")
        if self.capacity is not None and len(self.capacity) != n:
            raise ValueError("capacity must have one entry per sequence")

    @classmethod
    def single(
        cls, seq_id: int, tokens: list[int], start: int, num_logits: int = 1, taps: bool = False
    ) -> ForwardBatch:
        return cls(
            [seq_id],
            torch.tensor(tokens, dtype=torch.long),
            [len(tokens)],
            [start],
            [num_logits],
            taps,
        )


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [sum(num_logits), vocab] fp32, in batch order
    tap_hidden: torch.Tensor | None = None  # [T, L, hidden]: tapped layers' outputs
    tap_k: torch.Tensor | None = None  # [L, T, kv_heads, head_dim], post-RoPE as cached
    tap_v: torch.Tensor | None = None  # [L, T, kv_heads, head_dim]


@dataclass
class SeqSampling:
    """The sampling settings the target side needs for one sequence (rank 0 samples).

    Besides the distribution's shape (temperature, min-p, top-k, top-p) it carries the
    logits processors that depend on the sequence's own tokens (penalties, logit bias,
    ``min_tokens``; ``target_actor.logits_processors``) and how many log-probabilities
    to return per generated token (``logprobs``: None = none, 0 = the chosen token's only).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    stop_ids: tuple[int, ...] = ()  # masked until min_tokens tokens are out (EOS, stop ids)
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for the prompt's tokens, at prefill
    grammar: str | None = None  # llguidance grammar the output must follow

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """Whether the logits are processed before sampling (by the history or a bias)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or (self.min_tokens and self.stop_ids)
        )

    @property
    def counts_tokens(self) -> bool:
        """Whether the processors read the sequence's token counts (the penalties)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )


@dataclass
class PrefillBatch:
    """New sequences: run their prompts, sample each one's first token."""

    seq_ids: list[int]
    prompts: list[list[int]]
    sampling: list[SeqSampling]
    want_views: bool = True  # build the drafter's PrefillViews (spec mode)
    capacity: list[int] | None = None  # KV rows granted per sequence (ForwardBatch)


@dataclass
class ResumeBatch:
    """Preempted sequences coming back: rebuild each one's KV cache for ``tokens`` (its
    prompt, then every output token but the last, the next round's anchor) without
    sampling anything; its sampling state stayed on the ranks."""

    seq_ids: list[int]
    tokens: list[list[int]]
    prompt_lens: list[int]
    capacity: list[int]
    want_views: bool = True  # rebuild the drafter's views from this context (spec mode)


@dataclass
class VerifyBatch:
    """One round for running sequences: verify ``[anchor, d_1..d_num_draft]`` at ``position``.

    ``num_draft[i] == 0`` is a plain decoding step for sequence i (no proposal used).
    """

    seq_ids: list[int]
    anchors: list[int]  # last committed token, not yet in the target cache
    positions: list[int]  # == committed length of the target cache
    num_draft: list[int]  # drafts verified per sequence (<= the proposal's k)
    want_updates: bool = True  # build the drafter's RoundUpdates (spec mode)
    capacity: list[int] | None = None  # KV rows granted per sequence (ForwardBatch)

    def select(self, rows: list[int]) -> VerifyBatch:
        """The round of the sequences at ``rows`` only."""
        return VerifyBatch(
            [self.seq_ids[i] for i in rows],
            [self.anchors[i] for i in rows],
            [self.positions[i] for i in rows],
            [self.num_draft[i] for i in rows],
            self.want_updates,
            None if self.capacity is None else [self.capacity[i] for i in rows],
        )


@dataclass
class TokenLogprobs:
    """One generated token's log-probability and the most likely alternatives at its place
    (under the raw model distribution, as vLLM reports them by default)."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]
    rank: int | None = None  # the token's place in its row (1 = the most likely); prompts


@dataclass
class StepResult:
    """What the engine reads back from a prefill or a verify: tokens and counts only."""

    committed: list[list[int]]  # per sequence: accepted drafts + the recovered/bonus token
    num_accepted: list[int]  # per sequence: accepted drafts m (0 for prefill)
    # per sequence, one entry per committed token; None for sequences that asked for none
    logprobs: list[list[TokenLogprobs] | None] | None = None
    # prefill only: per sequence, one entry per prompt token after the first, if asked
    prompt_logprobs: list[list[TokenLogprobs] | None] | None = None
