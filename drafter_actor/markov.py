"""The Markov head (DSpark): a low-rank first-order correction, and block sampling with it.

The backbone gives base logits for all ``k`` slots at once; the head then adds, slot by
slot, ``B(x_{i-1}, ·) = W1[x_{i-1}] W2`` where ``x_{i-1}`` is the token drafted just before
(the anchor for slot 1). Each slot is drawn from the proposal ``q``: greedy (one-hot at
the argmax) or the drafter distribution ``softmax(logits / T)`` truncated to its top
``K_q`` entries and renormalised. ``q`` is returned exactly, so verification stays
lossless whatever the drafter.

Ids here are draft-vocabulary ids (``0..V_d-1``); a previous token outside the draft
vocabulary (only the anchor can be) uses the extra row ``V_d`` of ``W1``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from target_actor.linear import inference_linear, rows_through


class MarkovHead(nn.Module):
    w2t_q8 = None  # ``w2`` as int8 ``[V_d, r]`` rows (``DrafterNetwork.gemm_weights_int8``)
    native_greedy = None  # ``greedy`` in one C call, with ``w2t_q8`` (``native_pass.py``)

    def __init__(self, vocab: int, rank: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.zeros(vocab + 1, rank))  # [V_d + 1, r]; last: out of vocab
        self.w2 = nn.Parameter(torch.zeros(rank, vocab))  # [r, V_d]

    def forward(self, prev: torch.Tensor) -> torch.Tensor:
        """Transition bias ``[..., V_d]`` for previous draft ids ``prev`` ``[...]``."""
        rows = F.embedding(prev, self.w1)
        if self.w2t_q8 is not None and not torch.is_grad_enabled():  # int8 (VNNI) rows
            return rows_through(self.w2t_q8, rows)
        host_bf16 = self.w2.dtype == torch.bfloat16 and self.w2.device.type == "cpu"
        if torch.is_grad_enabled() or not host_bf16:  # the C GEMM only helps (and runs) there
            return rows @ self.w2
        return inference_linear(rows, self._w2_rows())

    def _w2_rows(self) -> torch.Tensor:
        """``w2`` as ``[V_d, r]`` rows for the C GEMM, kept until ``w2`` changes."""
        key = (self.w2.data_ptr(), self.w2._version)
        if getattr(self, "_w2t_key", None) != key:
            self._w2t, self._w2t_key = self.w2.detach().t().contiguous(), key
        return self._w2t

    def greedy(self, base: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """Greedy drafts ``[n, k]``: slot by slot, the argmax of its base logits plus the
        correction from the draft before it (the anchor for slot 1)."""
        if self.native_greedy is not None and not torch.is_grad_enabled():
            return self.native_greedy(base, anchor)
        prev, tokens = anchor, []
        for i in range(base.shape[1]):
            prev = (base[:, i] + self(prev)).float().argmax(-1)
            tokens.append(prev)
        return torch.stack(tokens, 1)

    def teacher_forced(self, base: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Corrected logits ``[n, k, V_d]`` given the true previous tokens ``prev`` ``[n, k]``."""
        return base + self(prev)


def sample_block(
    base: torch.Tensor,
    anchor: torch.Tensor,
    head: MarkovHead,
    temperature: torch.Tensor,
    uniforms: torch.Tensor,
    support: int,
    all_greedy: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draft ``k`` tokens left to right, vectorised over the batch.

    Args:
        base: ``[n, k, V_d]`` base logits of the k MASK slots.
        anchor: ``[n]`` draft id of each block's anchor (``V_d`` if outside the vocab).
        temperature: ``[n]``; ``<= 0`` drafts greedily.
        uniforms: ``[n, k]`` in ``[0, 1)``, drawn from each sequence's own generator.
        support: ``K_q``.
        all_greedy: whether every row drafts greedily, when the caller knows (read off
            ``temperature`` otherwise, which on a GPU waits for the device).

    Returns:
        draft tokens ``[n, k]``, and the proposal ``q`` as ids ``[n, k, K_q]`` and
        probabilities ``[n, k, K_q]`` (fp32, rows sum to 1, the drawn token in each row).
    """
    n, k, _ = base.shape
    greedy = (temperature <= 0).unsqueeze(-1)  # [n, 1]
    inv_t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).reciprocal()
    one_hot = torch.zeros(n, support, dtype=torch.float32, device=base.device)
    one_hot[:, 0] = 1.0
    prev, tokens, q_ids, q_probs = anchor, [], [], []
    vocab, offsets = base.shape[-1], torch.arange(support, device=base.device)
    if all_greedy is None:
        all_greedy = bool(greedy.all())
    if all_greedy:  # the loop below, for greedy rows only: what it draws, cheaper
        drafts = head.greedy(base, anchor)
        return drafts, (drafts[..., None] + offsets) % vocab, one_hot[:, None].expand(n, k, support)
    for i in range(k):
        logits = (base[:, i] + head(prev)).float() * inv_t.unsqueeze(-1)  # [n, V_d]
        # greedy rows: q is one-hot at the argmax, then the ids after it (distinct, no
        # mass), without a top-k; so a row's proposal does not depend on the batch's others
        ids = (logits.argmax(-1, keepdim=True) + offsets) % vocab
        top, top_ids = logits.topk(support, dim=-1)  # [n, K_q], sorted
        ids = torch.where(greedy, ids, top_ids)
        probs = torch.where(greedy, one_hot, torch.softmax(top, dim=-1))
        cdf = probs.cumsum(-1)  # inverse CDF never lands on a zero-probability entry...
        pick = torch.searchsorted(cdf, uniforms[:, i : i + 1] * cdf[:, -1:], right=True)
        # ... unless u * cdf rounds up to the total: then the last entry with mass (probs
        # are sorted, so those come first), never one whose q is 0 (it would always pass)
        last = (probs > 0).sum(-1, keepdim=True) - 1
        prev = ids.gather(-1, torch.minimum(pick, last)).squeeze(-1)  # [n]
        tokens.append(prev)
        q_ids.append(ids)
        q_probs.append(probs)
    return torch.stack(tokens, 1), torch.stack(q_ids, 1), torch.stack(q_probs, 1)
