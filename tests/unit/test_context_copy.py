"""Context copy: the n-gram match and the rule that merges it into a proposal.

The token history the drafter keeps for it is tested in ``test_drafter``.
"""

from __future__ import annotations

import torch

from drafter_actor.context_copy import MAX_NGRAM, apply_copies, find_copy
from target_actor.messages import Proposal


def ids(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.long)


def test_longest_then_most_recent_match():
    # "7 8" -> 1 (old, 2-gram) and "9 7 8" -> 2 (3-gram): the longer one wins
    assert find_copy(ids(9, 7, 8, 2, 3, 7, 8, 1, 9, 7), 8, 3) == ([2, 3, 7], 3)
    # two equally long matches: the most recent continuation
    assert find_copy(ids(5, 1, 5, 2, 6), 5, 2) == ([2, 6], 1)


def test_no_match_and_short_continuations():
    assert find_copy(ids(1, 2, 3), 4, 5) == ([], 0)
    assert find_copy(ids(), 4, 5) == ([], 0)
    # a copy that reaches the anchor repeats what it copied (the text is periodic)
    assert find_copy(ids(3, 4), 3, 5) == ([4, 3, 4, 3, 4], 1)
    assert find_copy(ids(0, 6, 6, 6), 6, 4) == ([6, 6, 6, 6], 3)
    assert find_copy(ids(1, 2, 1, 2, 1, 2), 1, 3) == ([2, 1, 2], 5)


def test_match_length_is_capped():
    hist = torch.full((40,), 4, dtype=torch.long)
    copy, n = find_copy(hist, 4, 3)
    assert n == MAX_NGRAM and copy == [4, 4, 4]
    assert find_copy(ids(9, 2, 3, 9), 2, 2) == ([3, 9], 2)  # a whole continuation


def proposal(tokens: list[list[int]], support: int = 3) -> Proposal:
    t = torch.tensor(tokens)
    q_ids = torch.stack([t, t + 100, t + 200], -1)[..., :support]
    q_probs = torch.full(q_ids.shape, 1.0 / support)
    return Proposal(t, q_ids, q_probs)


def test_rule_copies_long_matches_and_agreeing_single_tokens():
    base = proposal([[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9], [3, 3, 3, 3]])
    copies = [([40, 41], 2), ([5, 50, 51, 52, 53], 1), ([70], 1), ([], 0)]
    out, copied = apply_copies(base, copies)
    assert copied == 2
    # row 0: a 2-gram match, copied over the first two slots, the network's drafts after
    assert out.tokens[0].tolist() == [40, 41, 3, 4]
    # row 1: a 1-gram match whose first token agrees with the network: copied (k cut)
    assert out.tokens[1].tolist() == [5, 50, 51, 52]
    # ... but the agreeing slot keeps the network's q: its token was drawn from it
    assert torch.equal(out.q_ids[1, 0], base.q_ids[1, 0])
    assert torch.equal(out.q_probs[1, 0], base.q_probs[1, 0])
    assert out.q_probs[1, 1:].tolist() == [[1.0, 0.0, 0.0]] * 3
    # rows 2, 3: a disagreeing 1-gram match, and no match: the network's drafts
    assert torch.equal(out.tokens[2:], base.tokens[2:])
    assert torch.equal(out.q_probs[2:], base.q_probs[2:])
    # copied slots: q one-hot on the copied token (exact rejection sampling)
    assert torch.equal(out.q_ids[0, :2, 0], ids(40, 41))
    assert out.q_probs[0, :2].tolist() == [[1.0, 0.0, 0.0]] * 2
    assert torch.equal(out.q_probs[0, 2:], base.q_probs[0, 2:])
    assert torch.equal(base.tokens[0], ids(1, 2, 3, 4))  # the input is not modified


def test_nothing_copied_returns_the_same_proposal():
    base = proposal([[1, 2]])
    out, copied = apply_copies(base, [([3], 1)])
    assert out is base and copied == 0


def test_a_higher_sure_length_leaves_short_matches_to_the_network():
    base = proposal([[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]])
    copies = [([40, 41, 42, 43], 3), ([60, 61, 62, 63], 4), ([9, 90, 91, 92], 2)]
    out, copied = apply_copies(base, copies, sure_ngram=4)
    assert copied == 2
    assert torch.equal(out.tokens[0], base.tokens[0])  # 3 < 4 and no agreement: the network
    assert out.tokens[1].tolist() == [60, 61, 62, 63]  # long enough
    assert out.tokens[2].tolist() == [9, 90, 91, 92]  # short, but agrees with the network


def test_agreement_rule_keeps_the_target_distribution():
    """The reproduction of the bias the old rule had: a 3-token vocabulary, target
    p = [.5, .3, .2], network q = [.2, .5, .3], a 1-token match continuing with token 1
    and ``sure_ngram`` 8 (the shipped drafter's), so only the agreement rule can fire.
    The first emitted token must follow p; the old rule (slot 1 one-hot whenever the
    network drew token 1) gave [0.55, 0.15, 0.30]."""
    from target_actor.batch import SeqSampling
    from target_actor.rejection import rejection_sample

    n, k = 20_000, 2
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.5, 0.3])
    gen = torch.Generator().manual_seed(0)
    first = torch.multinomial(q, n, replacement=True, generator=gen)  # the network's draws
    tokens = torch.stack([first, torch.zeros(n, dtype=torch.long)], 1)  # [n, k]
    q_ids = torch.arange(3).expand(n, k, 3).clone()
    q_probs = q.expand(n, k, 3).clone()
    copies = [([1, 2], 1)] * n  # a 1-token match: its copy starts with token 1
    out, copied = apply_copies(Proposal(tokens, q_ids, q_probs), copies, sure_ngram=8)
    assert copied == int((first == 1).sum()) > 0
    logits = p.log().expand(n, k + 1, 3).clone()
    torch.manual_seed(1)
    res = rejection_sample(logits, out, [SeqSampling(temperature=1.0)] * n, [None] * n)
    emitted = torch.tensor([c[0] for c in res.committed])
    counts = torch.bincount(emitted, minlength=3).double()
    expected = p.double() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 13.8, f"first tokens {(counts / n).tolist()} (chi2 {chi2:.1f}, df 2)"
