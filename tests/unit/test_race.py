"""The sampler's draw (``rejection.draw``, ``csrc/sample.c``): a race on the support keyed
by one draw from the sequence's generator. Exact in distribution, the same token alone and
in any batch, and one key per token from a seeded stream."""

from __future__ import annotations

import pytest
import torch

from target_actor.native import library
from target_actor.rejection import RACE_KEYS, draw
from target_actor.sampling import _top_p, _top_p_torch, softmax
from tests.stats import chi2_threshold

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler: torch.multinomial")

P = torch.tensor([0.40, 0.0, 0.25, 0.15, 0.10, 0.0, 0.06, 0.04])


def chi2(counts: torch.Tensor, p: torch.Tensor, n: int) -> tuple[float, int]:
    keep = p > 0
    exp = p[keep].double() * n
    return float(((counts[keep].double() - exp) ** 2 / exp).sum()), int(keep.sum()) - 1


def counts_of(weights: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """``n`` draws from one seeded stream, a token at a time (as a sequence decodes)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.cat([draw(weights, [gen]) for _ in range(n)])
    return torch.bincount(tokens, minlength=weights.shape[-1])


def test_the_race_draws_the_distribution_and_a_planted_bias_fails():
    n = 40_000
    counts = counts_of(P[None] * 3.0, n, seed=1)  # unnormalised weights
    assert counts[P == 0].sum() == 0  # zero weight: never drawn
    stat, df = chi2(counts, P, n)
    assert stat < chi2_threshold(df), stat
    biased = P.clone()  # the same draws against a distribution off by 0.02 in two tokens
    biased[0], biased[2] = 0.38, 0.27
    stat, df = chi2(counts, biased, n)
    assert stat > chi2_threshold(df), stat


def test_a_seeded_row_draws_the_same_token_alone_and_in_a_batch():
    torch.manual_seed(0)
    weights = softmax(torch.randn(6, 500) * 2)
    alone = [int(draw(weights[i : i + 1], [torch.Generator().manual_seed(i)])) for i in range(6)]
    gens = [torch.Generator().manual_seed(i) for i in range(6)]
    assert draw(weights, gens).tolist() == alone
    gens = [torch.Generator().manual_seed(i) for i in range(6)][::-1]
    assert draw(weights.flip(0), gens).tolist() == alone[::-1]


def test_a_seeded_stream_advances_by_one_key_a_token():
    """Whatever the weights (one token or the whole vocabulary), so a later draw does not
    depend on how many tokens an earlier one could choose from."""
    for weights in (torch.eye(1, 300), torch.ones(1, 300)):
        gen, ref = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
        draw(weights, [gen])
        torch.randint(0, RACE_KEYS, (1,), generator=ref)
        assert torch.equal(gen.get_state(), ref.get_state())


def test_a_row_without_positive_weight_is_refused():
    with pytest.raises(RuntimeError, match="no token has a positive weight"):
        draw(torch.zeros(1, 10), [None])


def test_softmax_matches_torch_and_keeps_masked_tokens_at_zero():
    torch.manual_seed(1)
    x = torch.randn(5, 1000) * 20  # exps below fp32's normal range, as at temperature 0.2
    x[0, :10] = float("-inf")
    got = softmax(x)
    assert torch.allclose(got, torch.softmax(x, dim=-1), rtol=1e-5, atol=1e-12)
    assert (got[0, :10] == 0).all()
    assert all(torch.equal(softmax(x[i : i + 1])[0], got[i]) for i in range(5))


@pytest.mark.parametrize("scale", [15.0, 3.0])  # peaked (C's candidates), flat (whole sort)
def test_top_p_keeps_the_sorted_paths_tokens_each_row_alone(scale):
    torch.manual_seed(2)
    probs = softmax(torch.randn(4, 5000) * scale)
    got = _top_p(probs, 0.9)
    ref = _top_p_torch(probs, 0.9)
    assert torch.equal(got > 0, ref > 0)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-9)
    assert all(torch.equal(_top_p(probs[i : i + 1], 0.9)[0], got[i]) for i in range(4))
