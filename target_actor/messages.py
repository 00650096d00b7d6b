"""The messages between target and drafter: the one contract both actors share.

The target side builds ``PrefillViews`` (once per sequence) and ``RoundUpdate`` (every
round); the drafter consumes them. Every tensor here is fixed-size in the context length
``t``: at most ``W`` window rows, ``R`` summary slots, ``k`` rejected rows.

Notation: ``L`` tapped layers, ``d`` hidden size, ``H`` query heads, ``H_kv`` KV heads,
``hd`` head_dim, ``W`` window rows, ``R`` summary slots, ``k`` draft tokens, ``K_q``
proposal support. Keys are stored post-RoPE, exactly as the target caches them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

HISTORY_TOKENS = 2048  # committed token ids the drafter keeps (context copy), at most


class _Tensors:
    """Moving a message between devices: the target's GPU, host memory for Ray, the
    drafter's GPU. Every tensor field goes except the ones in ``HOST_FIELDS``."""

    HOST_FIELDS: tuple[str, ...] = ()

    def to(self, device: torch.device | str, non_blocking: bool = False):
        device = torch.device(device)
        moved = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in self.HOST_FIELDS:
                continue
            if isinstance(v, torch.Tensor) and v.device != device:
                moved[f.name] = v.to(device, non_blocking=non_blocking)
            elif isinstance(v, _Tensors):
                moved[f.name] = v.to(device, non_blocking)
        return dataclasses.replace(self, **moved) if moved else self

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data the message carries (what crosses between devices)."""
        total = 0
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
            elif isinstance(v, _Tensors):
                total += v.nbytes
        return total


@dataclass
class PrefillViews(_Tensors):
    """A new sequence's three views after the target prefilled its prompt."""

    HOST_FIELDS = ("tokens",)  # ids stay on the host: context copy searches them there

    seq_id: int
    length: int  # committed tokens in the target cache (positions 0..length-1)
    window_k: torch.Tensor  # [L, w, H_kv, hd], w = min(W, length): rows length-w..length-1
    window_v: torch.Tensor  # [L, w, H_kv, hd]
    summary_m: torch.Tensor  # [L, H, R, hd] fp32: attention outputs of G over rows 0..length-1
    summary_lam: torch.Tensor  # [L, H, R] fp32: their log-normalisers
    boundary: torch.Tensor  # [L, d]: tapped hidden states at position length-1
    seed: int | None = None  # seeds the drafter's own sampler for this sequence
    tokens: torch.Tensor | None = None  # [<= HISTORY_TOKENS] int64: the prompt's last ids


@dataclass
class RoundUpdate(_Tensors):
    """What one verification round hands the drafter for one sequence.

    The round verified ``[x_t, d_1..d_k]`` at positions ``t..t+k`` and accepted ``m``
    drafts; rows ``t..t+m`` are committed, the rest were rolled back.
    """

    HOST_FIELDS = ("tokens",)  # ids stay on the host: context copy searches them there

    seq_id: int
    length: int  # committed rows after the round: t + m + 1
    committed_k: torch.Tensor  # [L, m+1, H_kv, hd]: rows t..t+m
    committed_v: torch.Tensor  # [L, m+1, H_kv, hd]
    boundary: torch.Tensor  # [L, d]: tapped hidden states at t+m
    rejected: torch.Tensor  # [k-m, L, d]: tapped hidden states at t+m+1..t+k (may be empty)
    tokens: torch.Tensor | None = None  # [m+1] int64: the committed ids x_t, d_1..d_m


@dataclass
class DraftRequest(_Tensors):
    """One sequence's part of a ``propose`` call."""

    seq_id: int
    anchor: int  # the last committed token, not yet in the target cache
    position: int  # its absolute position (== committed length of the target cache)
    temperature: float = 0.0  # 0: greedy drafting (one-hot proposal)
    update: RoundUpdate | None = None  # the last round's result, applied before drafting


@dataclass
class Proposal(_Tensors):
    """Draft tokens and the exact proposal distribution each was sampled from."""

    tokens: torch.Tensor  # [n, k] int64
    q_ids: torch.Tensor  # [n, k, K_q] int64: support of q at each slot
    q_probs: torch.Tensor  # [n, k, K_q] fp32: q on that support, rows sum to 1


def scatter_proposal(part: Proposal, rows: list[int], n: int) -> Proposal:
    """A proposal for ``n`` sequences holding ``part`` at ``rows`` (others: padding, unused);
    ``part`` itself when it already covers all ``n`` in order."""
    if rows == list(range(n)):
        return part
    k, kq = part.q_ids.shape[1:]
    dev = part.tokens.device
    tokens = torch.full((n, k), -1, dtype=part.tokens.dtype, device=dev)
    q_ids = torch.zeros(n, k, kq, dtype=part.q_ids.dtype, device=dev)
    q_probs = torch.zeros(n, k, kq, dtype=part.q_probs.dtype, device=dev)
    q_probs[..., 0] = 1.0
    index = torch.tensor(rows, dtype=torch.long, device=dev)
    tokens[index], q_ids[index], q_probs[index] = part.tokens, part.q_ids, part.q_probs
    return Proposal(tokens, q_ids, q_probs)
