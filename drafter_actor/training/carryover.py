"""Carryover's parallel draft-verify step (Algorithm 2 of the Carryover paper).

At every anchor ``a``: a detached greedy draft ``d_1..d_k`` from the recorded prefix, the
frozen target verifying all branches of a sequence in one pass (``TargetPass``), the
accepted count ``m``, the anchor moved to ``a' = a + m + 1`` (the correction or bonus
position) and the branch's rejected hidden states (rows ``a+m+1..a+k``, inputs
``d_{m+1}..d_k``) carried to it, at positions ``a'..a+k`` as inference carries them.
The second draft, which the trainer runs with gradients, reads the recorded prefix
through ``a'`` plus these carry rows and learns the recorded continuation from ``a'``.
Fully accepted branches keep their anchor (shifted by ``k+1``) with empty carry.
"""

from __future__ import annotations

import torch

from drafter_actor.markov import sample_block
from drafter_actor.network import DrafterNetwork
from drafter_actor.training.target_pass import TargetPass
from drafter_actor.training.views import Anchors, AnchorViews, Batch, block_logits, build_views


def greedy_drafts(
    net: DrafterNetwork, base: torch.Tensor, anchor_tokens: torch.Tensor
) -> torch.Tensor:
    """What greedy drafting proposes from base logits ``[N, k, V_d]``: target ids ``[N, k]``."""
    N, k, _ = base.shape
    tokens, _, _ = sample_block(
        base, net.to_draft_ids(anchor_tokens), net.markov, torch.zeros(N), torch.zeros(N, k), 1
    )
    return net.d2t[tokens]


def draft_verify(
    net: DrafterNetwork,
    target: TargetPass,
    batch: Batch,
    anchors: Anchors,
    k: int,
    chunk: int = 32,
    first: tuple[AnchorViews, torch.Tensor] | None = None,
) -> tuple[Anchors, torch.Tensor, torch.Tensor, dict[str, float]]:
    """The detached first round at every anchor: shifted anchors and their carry rows.

    ``first``: the first draft's views and base logits when the caller already has them
    (it trains on them too); they are used detached here.

    Returns the shifted ``Anchors``, carry rows ``[B, A, k, L, d]`` with their mask
    ``[B, A, k]`` (for ``build_views``), and the first draft's mean accepted count.
    """
    with torch.no_grad():
        if first is None:
            views = build_views(net, batch, anchors, chunk)
            base = block_logits(net, views, batch, k)
        else:
            views, base = first[0], first[1].detach()
        drafts = greedy_drafts(net, base, batch.tokens[views.seq, views.pos])  # [N, k]
    N = len(views.pos)
    accepted = torch.zeros(N, dtype=torch.long)
    branch = torch.zeros(N, k + 1, *batch.hidden.shape[2:])  # [N, k + 1, L, d]
    for b in views.seq.unique().tolist():  # one pass per sequence, all its anchors at once
        sel = (views.seq == b).nonzero().squeeze(1)
        m, taps = target.verify_branches(
            batch.tokens[b, : int(batch.lengths[b])], views.pos[sel], drafts[sel]
        )
        accepted[sel], branch[sel] = m, taps
    shifted, carry, carry_mask = shift_anchors(
        anchors, views.pos, accepted, branch, batch.lengths[views.seq]
    )
    return shifted, carry, carry_mask, {"first_accepted": float(accepted.float().mean())}


def shift_anchors(
    anchors: Anchors,
    pos: torch.Tensor,
    accepted: torch.Tensor,
    branch: torch.Tensor,
    lengths: torch.Tensor,
) -> tuple[Anchors, torch.Tensor, torch.Tensor]:
    """Move each anchor to ``a' = a + m + 1`` and carry its branch's rejected rows.

    ``pos``, ``accepted``, ``lengths`` ``[N]`` per real anchor (in ``anchors.flat()``
    order); ``branch`` ``[N, k + 1, L, d]``: the tapped states of rows ``a..a+k``. The
    rejected rows ``a+m+1..a+k`` become carry rows ``0..k-m-1`` (at positions ``a'..``).
    Anchors whose ``a'`` leaves no label are dropped.
    """
    N, S = branch.shape[:2]
    k = S - 1
    shifted = pos + accepted + 1
    keep = shifted <= lengths - 2
    b, a = anchors.mask.nonzero(as_tuple=True)
    new_pos, new_mask = anchors.pos.clone(), anchors.mask.clone()
    new_pos[b, a] = torch.where(keep, shifted, torch.ones_like(shifted))
    new_mask[b, a] = keep
    rows = accepted.unsqueeze(1) + 1 + torch.arange(k)  # [N, k]: branch rows m+1..
    present = rows <= k
    rejected = branch[torch.arange(N).unsqueeze(1), rows.clamp(max=k)] * present[..., None, None]
    carry = torch.zeros(*anchors.pos.shape, k, *branch.shape[2:])
    carry_mask = torch.zeros(*anchors.pos.shape, k, dtype=torch.bool)
    carry[b, a], carry_mask[b, a] = rejected, present
    return Anchors(new_pos, new_mask), carry, carry_mask
