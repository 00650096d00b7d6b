"""The summary merge (LongSpark Eq. 4) and the target-side view builders, on random tensors."""

from __future__ import annotations

import pytest
import torch

from target_actor.summary import (
    attend_rows,
    build_prefill_views,
    build_round_update,
    empty_summary,
    merge_summary,
    update_summary,
)

L, H, H_KV, R, HD = 2, 4, 2, 3, 8


def reference(g: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Attention of G over all rows from scratch, in float64; query head h reads KV h // group."""
    group = g.shape[1] // k.shape[2]
    kk = k.double().repeat_interleave(group, dim=2).permute(0, 2, 1, 3)  # [L, H, n, hd]
    vv = v.double().repeat_interleave(group, dim=2).permute(0, 2, 1, 3)
    scores = g.double() @ kk.transpose(-1, -2) * scale  # [L, H, R, n]
    return torch.softmax(scores, -1) @ vv, torch.logsumexp(scores, -1)


def random_chunks(n: int, gen: torch.Generator) -> list[int]:
    sizes, left = [], n
    while left:
        sizes.append(min(left, int(torch.randint(1, 700, (1,), generator=gen))))
        left -= sizes[-1]
    return sizes


@pytest.mark.parametrize("n", [1, 2, 17, 300, 2500, 10_000])
def test_incremental_merge_equals_attention_from_scratch(n):
    gen = torch.Generator().manual_seed(n)
    g = torch.randn(L, H, R, HD, generator=gen)
    k = torch.randn(L, n, H_KV, HD, generator=gen) * 2
    v = torch.randn(L, n, H_KV, HD, generator=gen)
    m, lam = empty_summary(L, H, R, HD)
    start = 0
    for size in random_chunks(n, gen):
        m, lam = update_summary(
            m, lam, g, k[:, start : start + size], v[:, start : start + size], 0.35
        )
        start += size
    ref_m, ref_lam = reference(g, k, v, 0.35)
    assert m.dtype == lam.dtype == torch.float32
    assert (m.double() - ref_m).abs().max().item() <= 1e-5
    assert (lam.double() - ref_lam).abs().max().item() <= 1e-4


def test_merge_stays_finite_and_exact_with_scores_near_80():
    gen = torch.Generator().manual_seed(0)
    n = 10_000
    g = torch.nn.functional.normalize(torch.randn(L, H, R, HD, generator=gen), dim=-1) * 80
    # every row nearly parallel or anti-parallel to query 0 of KV head 0's first head
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    k = torch.randn(L, n, H_KV, HD, generator=gen) * 0.01
    k += sign.view(1, n, 1, 1) * torch.nn.functional.normalize(g[:, 0, 0], dim=-1).view(L, 1, 1, HD)
    v = torch.randn(L, n, H_KV, HD, generator=gen)
    m, lam = empty_summary(L, H, R, HD)
    for start in range(0, n, 333):
        m, lam = update_summary(
            m, lam, g, k[:, start : start + 333], v[:, start : start + 333], 1.0
        )
    ref_m, ref_lam = reference(g, k, v, 1.0)
    assert torch.isfinite(m).all() and torch.isfinite(lam).all()
    assert lam.max().item() > 88.8  # e^lam itself would overflow fp32
    assert (m.double() - ref_m).abs().max().item() <= 1e-5
    assert (lam.double() - ref_lam).abs().max().item() <= 1e-4


def test_empty_state_is_neutral_and_never_nan():
    gen = torch.Generator().manual_seed(1)
    e_m, e_lam = empty_summary(L, H, R, HD)
    m, lam = merge_summary(e_m, e_lam, e_m, e_lam)
    assert torch.equal(m, e_m) and torch.isneginf(lam).all()
    g = torch.randn(L, H, R, HD, generator=gen)
    k, v = torch.randn(L, 5, H_KV, HD, generator=gen), torch.randn(L, 5, H_KV, HD, generator=gen)
    x_m, x_lam = attend_rows(g, k, v, 0.3)
    for m, lam in (merge_summary(e_m, e_lam, x_m, x_lam), merge_summary(x_m, x_lam, e_m, e_lam)):
        assert torch.equal(m, x_m) and torch.equal(lam, x_lam)
    none = torch.zeros(L, 0, H_KV, HD)
    m, lam = update_summary(x_m, x_lam, g, none, none, 0.3)
    assert torch.equal(m, x_m) and torch.equal(lam, x_lam)


def test_summary_is_computed_in_fp32_from_low_precision_rows():
    gen = torch.Generator().manual_seed(2)
    g = torch.randn(L, H, R, HD, generator=gen)
    k, v = torch.randn(L, 40, H_KV, HD, generator=gen), torch.randn(L, 40, H_KV, HD, generator=gen)
    m, lam = attend_rows(g, k.bfloat16(), v.bfloat16(), 0.3)
    ref_m, _ = reference(g, k.bfloat16().float(), v.bfloat16().float(), 0.3)
    assert m.dtype == torch.float32 and (m.double() - ref_m).abs().max() <= 1e-5


@pytest.mark.parametrize("t", [1, 5, 8, 21])
def test_build_prefill_views_keeps_last_window_and_chunks_exactly(t):
    gen = torch.Generator().manual_seed(t)
    g = torch.randn(L, H, R, HD, generator=gen)
    tap_k, tap_v = (
        torch.randn(L, t, H_KV, HD, generator=gen),
        torch.randn(L, t, H_KV, HD, generator=gen),
    )
    hidden = torch.randn(t, L, 16, generator=gen)
    views = build_prefill_views(7, tap_k, tap_v, hidden, g, window=8, chunk=3, seed=11)
    w = min(8, t)
    assert views.seq_id == 7 and views.length == t and views.seed == 11
    assert torch.equal(views.window_k, tap_k[:, t - w :]) and torch.equal(
        views.window_v, tap_v[:, t - w :]
    )
    assert torch.equal(views.boundary, hidden[-1])
    ref_m, ref_lam = reference(g, tap_k, tap_v, HD**-0.5)
    assert (views.summary_m.double() - ref_m).abs().max() <= 1e-5
    assert (views.summary_lam.double() - ref_lam).abs().max() <= 1e-5


def test_build_round_update_splits_committed_and_rejected_rows():
    k_len, m = 6, 2  # verify block of k+1 = 7 rows at positions 40..46
    tap_k, tap_v = torch.randn(L, k_len + 1, H_KV, HD), torch.randn(L, k_len + 1, H_KV, HD)
    hidden = torch.randn(k_len + 1, L, 16)
    u = build_round_update(3, 40, m, tap_k, tap_v, hidden)
    assert u.length == 43 and u.seq_id == 3
    assert torch.equal(u.committed_k, tap_k[:, :3]) and torch.equal(u.committed_v, tap_v[:, :3])
    assert torch.equal(u.boundary, hidden[2]) and torch.equal(u.rejected, hidden[3:])
    full = build_round_update(3, 40, k_len, tap_k, tap_v, hidden)
    assert full.rejected.shape[0] == 0 and full.length == 47
    with pytest.raises(ValueError):
        build_round_update(3, 40, k_len + 1, tap_k, tap_v, hidden)


def test_summary_module_imports_only_torch():
    import ast
    import inspect

    import target_actor.summary as summary

    tree = ast.parse(inspect.getsource(summary))
    imported = {
        (node.module or "") if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert imported <= {"__future__", "torch", "target_actor.messages"}, imported
