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
    """

    seq_ids: list[int]
    token_ids: torch.Tensor  # [T] int64, the sequences' new tokens concatenated
    num_new: list[int]  # per sequence, sums to T
    start_pos: list[int]  # per sequence, position of its first new token
    num_logits: list[int]  # per sequence: logits for its last num_logits[i] new tokens
    return_taps: bool = False

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
