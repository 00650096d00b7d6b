"""The drafter's three views at many anchors at once, built as inference builds them.

For a sequence with committed tokens ``0..t-1`` and the anchor ``x_t`` at position ``t``:

* boundary: the tapped hidden states at ``t-1``, fused, a K/V row at position ``t-1``;
* window: the target's K/V rows of positions ``max(0, t-W)..t-1`` (as cached, post-RoPE);
* summary: attention of ``G`` over rows ``0..t-1`` (``M``, ``λ``), by a causal prefix scan;
* carry (Carryover only): rejected hidden states ``+ E_carry`` at positions ``t, t+1, ...``;

the block ``[x_t, MASK x k]`` sits at positions ``t..t+k`` and MASK slot ``i`` predicts the
token at ``t+i``. The context layout is the inference one (``Drafter._contexts``):
``[window (W) ; boundary (1) ; carry]``, with masks for missing rows.

The summary scan: rows are cut into chunks of ``C``; each chunk's (max-stabilised)
attention sums are computed once, and each anchor merges the full chunks before it with
the part of its own chunk before it (the exact merge of ``summary.merge_summary``). Cost
``O(T + A * C)`` per layer and slot instead of ``O(A * T)``; no ``-inf`` anywhere, so the
gradient to ``G`` stays finite.

Shapes: ``B`` sequences padded to ``T`` rows; ``A`` anchors per sequence (padded, with a
mask); ``N`` real anchors after flattening; ``L`` layers, ``H``/``H_kv`` heads, ``R``
slots, ``hd`` head_dim, ``d`` hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from drafter_actor.context_copy import copies_in_text
from drafter_actor.network import DrafterNetwork, LayerContext

NEG = -1e30  # "no row": exp(NEG - x) == 0 for any finite score x, and never NaN


@dataclass
class Batch:
    """``B`` sequences' tokens and cached taps, padded to ``T`` rows."""

    tokens: torch.Tensor  # [B, T] int64 (0 past the end)
    lengths: torch.Tensor  # [B] int64
    hidden: torch.Tensor  # [B, T, L, d] fp32
    k: torch.Tensor  # [B, T, L, H_kv, hd] fp32, post-RoPE
    v: torch.Tensor  # [B, T, L, H_kv, hd] fp32
    # [B, T] int64: the target's greedy token after each row, for text it did not write
    # itself (``None``: every sequence is the target's own, the next recorded token is it)
    next_tokens: torch.Tensor | None = None

    @classmethod
    def collate(
        cls,
        items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
        next_tokens: list[torch.Tensor | None] | None = None,
    ) -> Batch:
        """From per-sequence ``(tokens [T_b], hidden [T_b, L, d], k, v [T_b, L, H_kv, hd])``
        and, for sequences the target did not write, its greedy next tokens ``[T_b]``."""
        lengths = torch.tensor([t.shape[0] for t, *_ in items])
        T = int(lengths.max())

        def pad(x: torch.Tensor) -> torch.Tensor:
            return F.pad(x, (0, 0) * (x.dim() - 1) + (0, T - x.shape[0]))

        tokens = torch.stack([pad(t.long()) for t, *_ in items])
        nxt = None
        if next_tokens is not None and any(n is not None for n in next_tokens):
            own = F.pad(tokens[:, 1:], (0, 1))  # the target's own text: its next token
            nxt = torch.stack(
                [own[b] if n is None else pad(n.long()) for b, n in enumerate(next_tokens)]
            )
        return cls(
            tokens=tokens,
            lengths=lengths,
            hidden=torch.stack([pad(h.float()) for _, h, _, _ in items]),
            k=torch.stack([pad(k.float()) for *_, k, _ in items]),
            v=torch.stack([pad(v.float()) for *_, v in items]),
            next_tokens=nxt,
        )


@dataclass
class Anchors:
    """Anchor positions per sequence, padded: ``pos`` ``[B, A]`` where ``mask``."""

    pos: torch.Tensor  # [B, A] int64 (1 where padded)
    mask: torch.Tensor  # [B, A] bool

    @classmethod
    def pad(cls, per_seq: list[torch.Tensor]) -> Anchors:
        A = max(1, max(len(a) for a in per_seq))
        pos = torch.ones(len(per_seq), A, dtype=torch.long)
        mask = torch.zeros(len(per_seq), A, dtype=torch.bool)
        for b, a in enumerate(per_seq):
            pos[b, : len(a)] = a
            mask[b, : len(a)] = True
        return cls(pos, mask)

    def flat(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(seq index [N], position [N])`` of the real anchors, row-major."""
        b, a = self.mask.nonzero(as_tuple=True)
        return b, self.pos[b, a]


def sample_anchors(length: int, prompt_len: int, count: int, gen: torch.Generator) -> torch.Tensor:
    """Up to ``count`` distinct anchors in the response, ``prompt_len..length-2``, sorted."""
    n = max(0, length - 1 - prompt_len)
    pick = torch.randperm(n, generator=gen)[: min(count, n)]
    return (pick + prompt_len).sort().values


def prefix_summary(
    g: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    anchors: torch.Tensor,
    scale: float,
    chunk: int = 32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summary of rows ``0..a-1`` at every anchor ``a``, by a causal prefix scan.

    Args:
        g: ``[L, H, R, hd]`` summary queries (gradients flow to them).
        k, v: ``[B, T, L, H_kv, hd]`` target rows (post-RoPE keys).
        anchors: ``[B, A]`` positions ``1 <= a <= T``.

    Returns:
        ``M`` ``[B, A, L, H, R, hd]`` and ``λ`` ``[B, A, L, H, R]``, equal to
        ``summary.update_summary`` over the same rows.
    """
    B, T, L, Hkv, hd = k.shape
    H, R = g.shape[1], g.shape[2]
    Q, C = (H // Hkv) * R, chunk  # query head h reads KV head h // (H / H_kv)
    n = -(-T // C)
    if n * C != T:
        k = F.pad(k, (0, 0, 0, 0, 0, 0, 0, n * C - T))
        v = F.pad(v, (0, 0, 0, 0, 0, 0, 0, n * C - T))
    vc = v.view(B, n, C, L, Hkv, hd)
    s = torch.einsum("lkqd,btlkd->blkqt", g.reshape(L, Hkv, Q, hd), k) * scale
    s = s.reshape(B, L, Hkv, Q, n, C)  # scores of every row, by chunk

    # every chunk on its own: log-normaliser and mean value
    c = s.detach().amax(-1, keepdim=True)
    e = torch.exp(s - c)
    den = e.sum(-1)  # >= 1
    lam_chunk = c.squeeze(-1) + den.log()  # [B, L, H_kv, Q, n]
    mean_chunk = torch.einsum("blkqnc,bnclkd->blkqnd", e, vc) / den.unsqueeze(-1)

    # the whole chunks before each anchor's chunk, merged
    J, o = anchors // C, anchors % C  # [B, A]
    before = torch.arange(n) < J.unsqueeze(-1)  # [B, A, n]
    lam_sel = lam_chunk.unsqueeze(4).masked_fill(~before[:, None, None, None], NEG)
    lam_full = torch.logsumexp(lam_sel, -1)  # [B, L, H_kv, Q, A]
    w = torch.exp(lam_sel - lam_full.unsqueeze(-1))  # [B, L, H_kv, Q, A, n]
    m_full = torch.einsum("blkqaj,blkqjd->blkqad", w, mean_chunk)

    # the rows of the anchor's own chunk before it
    A = anchors.shape[1]
    s_part = torch.gather(s, 4, J[:, None, None, None, :, None].expand(B, L, Hkv, Q, A, C))
    own = torch.arange(C) < o.unsqueeze(-1)  # [B, A, C]
    s_part = s_part.masked_fill(~own[:, None, None, None], NEG)
    c_part = s_part.detach().amax(-1, keepdim=True)
    e_part = torch.exp(s_part - c_part)
    den_part = e_part.sum(-1)
    v_part = vc[torch.arange(B)[:, None], J]  # [B, A, C, L, H_kv, hd]
    m_part = torch.einsum("blkqac,baclkd->blkqad", e_part, v_part) / den_part.unsqueeze(-1)
    lam_part = c_part.squeeze(-1) + den_part.log()

    lam = torch.logaddexp(lam_full, lam_part)  # Eq. 4
    m = (lam_full - lam).exp().unsqueeze(-1) * m_full + (lam_part - lam).exp().unsqueeze(
        -1
    ) * m_part
    m = m.permute(0, 4, 1, 2, 3, 5).reshape(B, A, L, H, R, hd)
    return m, lam.permute(0, 4, 1, 2, 3).reshape(B, A, L, H, R)


@dataclass
class AnchorViews:
    """The contexts of ``N`` anchors, ready for ``DrafterNetwork.forward``."""

    contexts: list[LayerContext]  # one per drafter layer, over N anchors
    seq: torch.Tensor  # [N] batch row of each anchor
    pos: torch.Tensor  # [N] anchor position t
    boundary: torch.Tensor  # [N, d]: fused boundary states (the block input reads them too)


def build_views(
    net: DrafterNetwork,
    batch: Batch,
    anchors: Anchors,
    chunk: int = 32,
    carry: torch.Tensor | None = None,
    carry_mask: torch.Tensor | None = None,
) -> AnchorViews:
    """Every real anchor's context, as ``Drafter._contexts`` would build it at inference.

    ``carry`` ``[B, A, c, L, d]`` / ``carry_mask`` ``[B, A, c]``: rejected hidden states
    carried to each anchor (Carryover), at positions ``t..t+c-1``.
    """
    cfg = net.cfg
    W, L = cfg.window, cfg.num_layers
    scale = cfg.target.head_dim**-0.5
    m, lam = prefix_summary(net.summary_queries, batch.k, batch.v, anchors.pos, scale, chunk)
    b, pos = anchors.flat()
    sel = anchors.mask
    m, lam = m[sel], lam[sel]  # [N, L, H, R, hd], [N, L, H, R]

    boundary = net.fuse(batch.hidden[b, pos - 1])  # [N, d]
    feats = boundary.unsqueeze(1)  # [N, 1, d]: the boundary row
    rows_pos = (pos - 1).unsqueeze(1)  # [N, 1]
    rows_mask = torch.ones(len(b), 1, dtype=torch.bool)
    if carry is not None:
        feats = torch.cat([feats, net.carry_features(carry[sel])], 1)  # [N, 1 + c, d]
        rows_pos = torch.cat([rows_pos, pos.unsqueeze(1) + torch.arange(carry.shape[2])], 1)
        rows_mask = torch.cat([rows_mask, carry_mask[sel]], 1)
    rows = net.project_context(feats, rows_pos)  # L x [N, H_kv, 1 + c, hd]

    idx = pos.unsqueeze(1) - W + torch.arange(W)  # [N, W]: positions t-W..t-1
    win_mask = idx >= 0
    idx = idx.clamp(min=0)
    win_k = batch.k[b.unsqueeze(1), idx].permute(2, 0, 3, 1, 4)  # [L, N, H_kv, W, hd]
    win_v = batch.v[b.unsqueeze(1), idx].permute(2, 0, 3, 1, 4)
    mask = torch.cat([win_mask, rows_mask], 1)  # [N, W + 1 + c]
    summary_mask = lam > NEG / 2
    contexts = [
        LayerContext(
            k=torch.cat([win_k[i], rows[i][0]], 2),
            v=torch.cat([win_v[i], rows[i][1]], 2),
            mask=mask,
            summary_m=m[:, i],
            summary_mask=summary_mask[:, i],
        )
        for i in range(L)
    ]
    return AnchorViews(contexts, b, pos, boundary)


def block_logits(net: DrafterNetwork, views: AnchorViews, batch: Batch, k: int) -> torch.Tensor:
    """Base logits ``[N, k, V_d]`` of the block ``[x_t, MASK x k]`` at every anchor."""
    anchor_tokens = batch.tokens[views.seq, views.pos]  # [N]
    positions = views.pos.unsqueeze(1) + torch.arange(k + 1)  # [N, k + 1]
    copies = copies_in_text(batch.tokens, views.seq, views.pos, k) if net.cfg.copy_input else None
    x = net.embed_block(anchor_tokens, k, views.boundary, copies)
    h = net(x, positions, views.contexts)
    return net.logits(h[:, 1:])


def block_labels(batch: Batch, views: AnchorViews, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's greedy tokens at ``t+1..t+k`` (target ids) ``[N, k]`` and where known.

    For the target's own text they are the recorded tokens. For other text
    (``batch.next_tokens``) slot ``i``'s label is the target's greedy token after row
    ``t+i-1``; it is the target's greedy continuation of the anchor only while the text
    before it agrees with the target (rows ``t+1..t+i-1`` are its greedy picks), so a slot
    counts only up to the first disagreement.
    """
    seq, T = views.seq.unsqueeze(1), batch.tokens.shape[1]
    idx = views.pos.unsqueeze(1) + torch.arange(1, k + 1)  # [N, k]
    valid = idx < batch.lengths[views.seq].unsqueeze(1)
    at = idx.clamp(max=T - 1)
    if batch.next_tokens is None:
        return batch.tokens[seq, at], valid
    labels = batch.next_tokens[seq, at - 1]
    agree = (batch.tokens[seq, at] == labels) | ~valid  # row t+i is the target's pick
    consistent = torch.cat([torch.ones_like(agree[:, :1]), agree[:, :-1].cumprod(1).bool()], 1)
    return labels, valid & consistent
