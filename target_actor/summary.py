"""The global summary view: learned queries ``G`` attending over all of a layer's K/V rows.

Per tapped layer and query head, ``R`` queries ``G`` keep the attention output ``M`` over
every committed row and its log-normaliser ``λ`` (LongSpark Eq. 3). New rows are merged
exactly, without looking at the old ones (Eq. 4):

    λ' = log(e^λ + e^λΔ),   M' = e^(λ-λ') M + e^(λΔ-λ') MΔ

where ``(MΔ, λΔ)`` is the attention of ``G`` over the new rows alone. The empty state is
``λ = -inf, M = 0``. With GQA, query head ``h`` reads KV head ``h // (H / H_kv)``.
Keys are the target's, post-RoPE as cached; ``G`` itself gets no RoPE.

Also here: the two pure builders the target side calls to make the drafter's messages
(``build_prefill_views`` once per sequence, ``build_round_update`` every round). This
module imports only torch (and the message dataclasses), so the target can use it
without the drafter network.

Shapes: ``L`` tapped layers, ``H`` query heads, ``H_kv`` KV heads, ``R`` slots,
``hd`` head_dim, ``n`` rows. Everything is computed in fp32.
"""

from __future__ import annotations

import torch

from target_actor.messages import HISTORY_TOKENS, PrefillViews, RoundUpdate

DEFAULT_CHUNK = 2048


def empty_summary(
    num_layers: int, num_heads: int, slots: int, head_dim: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The summary of no rows: ``M = 0`` ``[L, H, R, hd]``, ``λ = -inf`` ``[L, H, R]``."""
    m = torch.zeros(num_layers, num_heads, slots, head_dim, device=device)
    lam = torch.full((num_layers, num_heads, slots), float("-inf"), device=device)
    return m, lam


def attend_rows(
    g: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``G`` over some rows: ``(MΔ [L, H, R, hd], λΔ [L, H, R])``.

    ``g`` ``[L, H, R, hd]``; ``k``, ``v`` ``[L, n, H_kv, hd]`` (any float dtype). For
    ``n == 0`` this is the empty summary.
    """
    L, H, R, hd = g.shape
    n, h_kv = k.shape[1], k.shape[2]
    if n == 0:
        return empty_summary(L, H, R, hd, g.device)
    group = H // h_kv
    gg = g.float().reshape(L, h_kv, group * R, hd)  # query head h -> KV head h // group
    kk = k.float().permute(0, 2, 3, 1)  # [L, H_kv, hd, n]
    vv = v.float().transpose(1, 2)  # [L, H_kv, n, hd]
    scores = torch.matmul(gg, kk) * scale  # [L, H_kv, group * R, n]
    lam = torch.logsumexp(scores, dim=-1)  # [L, H_kv, group * R]
    m = torch.matmul(torch.exp(scores - lam.unsqueeze(-1)), vv)  # [L, H_kv, group * R, hd]
    return m.reshape(L, H, R, hd), lam.reshape(L, H, R)


def merge_summary(
    m: torch.Tensor, lam: torch.Tensor, m_new: torch.Tensor, lam_new: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two summaries of disjoint row sets exactly (Eq. 4); either may be empty."""
    lam_out = torch.logaddexp(lam, lam_new)  # -inf only where both are -inf
    empty = torch.isneginf(lam_out)
    safe = torch.where(empty, torch.zeros_like(lam_out), lam_out)
    w_old = torch.exp(lam - safe).masked_fill(empty, 0.0).unsqueeze(-1)  # [L, H, R, 1]
    w_new = torch.exp(lam_new - safe).masked_fill(empty, 0.0).unsqueeze(-1)
    return w_old * m + w_new * m_new, lam_out


def update_summary(
    m: torch.Tensor,
    lam: torch.Tensor,
    g: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    chunk: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge rows ``k``, ``v`` ``[L, n, H_kv, hd]`` into ``(M, λ)``, ``chunk`` rows at a time.

    The one function for both the target-side prefill (many rows, chunked to bound the
    ``[L, H, R, chunk]`` score buffer) and the drafter's per-round update (``m+1`` rows).
    """
    for start in range(0, k.shape[1], chunk):
        m_new, lam_new = attend_rows(
            g, k[:, start : start + chunk], v[:, start : start + chunk], scale
        )
        m, lam = merge_summary(m, lam, m_new, lam_new)
    return m, lam


def history_tensor(tokens: list[int] | torch.Tensor | None) -> torch.Tensor | None:
    """The last ``HISTORY_TOKENS`` of a prompt's ids as int64 (``None`` stays ``None``)."""
    if tokens is None:
        return None
    # host memory on every device: the drafter's context copy searches it there
    return torch.as_tensor(tokens, dtype=torch.long, device="cpu")[-HISTORY_TOKENS:].clone()


def build_prefill_views(
    seq_id: int,
    tap_k: torch.Tensor,
    tap_v: torch.Tensor,
    tap_hidden: torch.Tensor,
    g: torch.Tensor,
    window: int,
    scale: float | None = None,
    chunk: int = DEFAULT_CHUNK,
    seed: int | None = None,
    tokens: list[int] | torch.Tensor | None = None,
) -> PrefillViews:
    """A new sequence's fixed-size views from its prompt's taps (positions ``0..t-1``).

    ``tap_k``, ``tap_v`` ``[L, t, H_kv, hd]`` (post-RoPE, as cached) and ``tap_hidden``
    ``[t, L, d]`` as the target's forward returns them; ``g`` is the drafter's
    ``summary_queries()``; ``scale`` defaults to ``hd ** -0.5``; ``tokens``: the prompt's
    ids (its last ``HISTORY_TOKENS`` go to the drafter's context copy).
    """
    t = tap_k.shape[1]
    if t < 1 or tap_hidden.shape[0] != t or tap_v.shape != tap_k.shape:
        raise ValueError(
            f"taps disagree: k {tuple(tap_k.shape)}, v {tuple(tap_v.shape)}, "
            f"hidden {tuple(tap_hidden.shape)} (need t >= 1 rows each)"
        )
    scale = g.shape[-1] ** -0.5 if scale is None else scale
    m, lam = empty_summary(*g.shape, device=g.device)
    m, lam = update_summary(m, lam, g, tap_k, tap_v, scale, chunk)
    w = min(window, t)
    return PrefillViews(
        seq_id=seq_id,
        length=t,
        window_k=tap_k[:, t - w :].clone(),
        window_v=tap_v[:, t - w :].clone(),
        summary_m=m,
        summary_lam=lam,
        boundary=tap_hidden[t - 1].clone(),
        seed=seed,
        tokens=history_tensor(tokens),
    )


def build_round_update(
    seq_id: int,
    start: int,
    accepted: int,
    tap_k: torch.Tensor,
    tap_v: torch.Tensor,
    tap_hidden: torch.Tensor,
    tokens: list[int] | torch.Tensor | None = None,
) -> RoundUpdate:
    """One sequence's ``RoundUpdate`` from the taps of its verify block.

    The block was ``[x_t, d_1..d_k]`` at positions ``start..start+k``: ``tap_k``,
    ``tap_v`` ``[L, k+1, H_kv, hd]``, ``tap_hidden`` ``[k+1, L, d]``; ``accepted`` = m
    drafts were accepted, so rows ``0..m`` are committed and ``m+1..k`` rejected;
    ``tokens``: the block's ids (the committed ``m + 1`` of them go to the drafter).
    """
    m = accepted
    if not 0 <= m < tap_hidden.shape[0]:
        raise ValueError(f"accepted={m} outside 0..{tap_hidden.shape[0] - 1}")
    return RoundUpdate(
        seq_id=seq_id,
        length=start + m + 1,
        committed_k=tap_k[:, : m + 1].clone(),
        committed_v=tap_v[:, : m + 1].clone(),
        boundary=tap_hidden[m].clone(),
        rejected=tap_hidden[m + 1 :].clone(),
        tokens=None
        if tokens is None
        else torch.as_tensor(tokens, dtype=torch.long, device="cpu")[: m + 1],
    )
