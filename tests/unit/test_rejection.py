"""Rejection sampler: constructed greedy cases, the output distribution, and seeding."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine.params import SamplingParams
from target_actor.messages import Proposal
from target_actor.rejection import RejectionResult, draw, rejection_sample
from target_actor.sampling import target_probs


def sample_next(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """Plain decoding's reference: one token from ``logits`` ``[vocab]`` under ``params``."""
    if params.greedy:
        return int(logits.argmax())
    probs = target_probs(logits.unsqueeze(0), params.temperature, params.top_k, params.top_p)
    return int(draw(probs, [gen])[0])


GREEDY = SamplingParams()
VOCAB = 100


def forced_logits(target_tokens: list[list[int]], vocab: int = VOCAB) -> torch.Tensor:
    """``[n, k + 1, vocab]`` logits whose row ``j`` has its argmax at ``target_tokens[i][j]``."""
    logits = torch.full((len(target_tokens), len(target_tokens[0]), vocab), -100.0)
    for i, row in enumerate(target_tokens):
        for j, tok in enumerate(row):
            logits[i, j, tok] = 100.0
    return logits


def one_hot_proposal(tokens: torch.Tensor | list[list[int]]) -> Proposal:
    """Greedy drafting: ``q`` puts all its mass on the draft token."""
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    return Proposal(tokens, tokens[..., None].clone(), torch.ones(*tokens.shape, 1))


def run_greedy(drafts, target_tokens, num_draft=None) -> RejectionResult:
    n = len(drafts)
    return rejection_sample(
        forced_logits(target_tokens), one_hot_proposal(drafts), [GREEDY] * n, [None] * n, num_draft
    )


def check_consistent(result: RejectionResult, tokens: torch.Tensor, num_draft: list[int]) -> None:
    for i, c in enumerate(result.committed):
        m = int(result.num_accepted[i])
        assert c == tokens[i, :m].tolist() + [int(result.output_token[i])]
        assert bool(result.bonus[i]) == (m == num_draft[i])


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    """Total variation distance between distributions over the last dimension."""
    return 0.5 * float((a - b).abs().sum(-1).min())


# ---------------------------------------------------------------- greedy, constructed logits


def test_perfect_match():
    """Every draft agrees with the target argmax: all accepted, then the bonus token."""
    result = run_greedy([[1, 2, 3]], [[1, 2, 3, 4]])
    assert result.committed == [[1, 2, 3, 4]]
    assert result.num_accepted.tolist() == [3]
    assert result.output_token.tolist() == [4]
    assert result.bonus.tolist() == [True]


def test_early_mismatch():
    """The first draft is wrong: nothing accepted, recovered = the target argmax at row 0."""
    result = run_greedy([[1, 2, 3]], [[5, 2, 3, 4]])
    assert result.committed == [[5]]
    assert result.num_accepted.tolist() == [0]
    assert result.bonus.tolist() == [False]


def test_all_rejected():
    """No draft matches anywhere: each sequence commits only its recovered token."""
    result = run_greedy([[1, 2, 3], [4, 5, 6]], [[7, 8, 9, 10], [11, 12, 13, 14]])
    assert result.committed == [[7], [11]]
    assert result.num_accepted.tolist() == [0, 0]


def test_mismatch_in_the_middle():
    """Later drafts are not accepted after a mismatch, even when they match their rows."""
    result = run_greedy([[1, 2, 3]], [[1, 7, 3, 4]])
    assert result.committed == [[1, 7]]
    assert result.output_token.tolist() == [7]


@pytest.mark.parametrize(
    "drafts,target_tokens,expected",
    [
        ([[1, 2]], [[1, 2, 3]], [[1, 2, 3]]),  # perfect match with bonus
        ([[1]], [[2, 3]], [[2]]),  # first mismatch
        ([[1, 2], [3, 4]], [[1, 5, 6], [3, 4, 7]], [[1, 5], [3, 4, 7]]),  # mixed
    ],
)
def test_parametrized_cases(drafts, target_tokens, expected):
    assert run_greedy(drafts, target_tokens).committed == expected


def test_ragged_num_draft():
    """Each sequence uses only its first num_draft drafts; 0 is a plain decoding step."""
    drafts = [[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3]]
    target_tokens = [[1, 2, 3, 4], [1, 9, 9, 9], [1, 2, 3, 4], [8, 2, 3, 4]]
    num_draft = [3, 1, 0, 2]
    result = run_greedy(drafts, target_tokens, num_draft)
    # seq 1: draft 2 would mismatch, but it is past num_draft -> bonus from row 1
    # seq 2: draft 1 would match, but there are no drafts -> plain step from row 0
    assert result.committed == [[1, 2, 3, 4], [1, 9], [1], [8]]
    assert result.num_accepted.tolist() == [3, 1, 0, 0]
    assert result.bonus.tolist() == [True, True, True, False]


def test_unused_slots_may_hold_padding():
    """Slots past num_draft are never read, so padding ids (-1) are harmless."""
    logits, proposal, _ = make_batch(4, 3, 50, seed=7)
    num_draft = [0, 1, 2, 3]
    for i, d in enumerate(num_draft):
        proposal.tokens[i, d:] = -1
        proposal.q_ids[i, d:] = -1
    params = [GREEDY, SamplingParams(temperature=1.0)] * 2
    for sp in params:
        result = rejection_sample(logits, proposal, [sp] * 4, [None] * 4, num_draft)
        check_consistent(result, proposal.tokens, num_draft)
        assert all(tok >= 0 for c in result.committed for tok in c)


def test_k_zero():
    """A round with no draft slots at all is plain decoding for the whole batch."""
    logits = forced_logits([[5], [6]])
    empty = Proposal(
        torch.empty(2, 0, dtype=torch.long),
        torch.empty(2, 0, 3, dtype=torch.long),
        torch.empty(2, 0, 3),
    )
    sampled = SamplingParams(temperature=1.0, seed=1)
    result = rejection_sample(logits, empty, [GREEDY, sampled], [None, sampled.generator()])
    assert result.committed == [[5], [6]]


def test_a_plain_round_takes_the_general_paths_tokens():
    """Rounds without drafts take a short path: the same tokens as the general one (here
    forced by a sixth sequence that drafts), greedy and seeded sampled rows alike."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 2, VOCAB, generator=gen)
    logits[1, 0, 3] = logits[1, 0, 4] = logits[1, 0].max() + 1  # a tie: the first index
    params = [GREEDY, GREEDY, SamplingParams(temperature=1.0, seed=1)]
    params += [SamplingParams(temperature=0.7, top_p=0.8, seed=2)]
    params += [SamplingParams(temperature=0.9, top_k=5, seed=4)]
    ragged = torch.cat([logits[:5, 0], logits[5]])  # five plain rows, then two for the drafter

    def plain_round(n: int, num_draft: list[int]) -> list[list[int]]:
        tokens = torch.tensor([[0]] * 5 + [[int(logits[5, 0].argmax())]])[:n]
        prop = Proposal(tokens, tokens[..., None], torch.ones(n, 1, 1))
        gens = [p.generator() for p in [*params, GREEDY][:n]]
        rows = ragged[: n + (n == 6)]
        return rejection_sample(rows, prop, [*params, GREEDY][:n], gens, num_draft).committed

    fast = plain_round(5, [0] * 5)
    general = plain_round(6, [0] * 5 + [1])
    assert fast == general[:5] and fast[1] == [3]
    empty = Proposal(
        torch.empty(5, 0, dtype=torch.long),
        torch.empty(5, 0, 3, dtype=torch.long),
        torch.empty(5, 0, 3),
    )
    dense = rejection_sample(logits[:5, :1], empty, params, [p.generator() for p in params])
    assert dense.committed == fast and dense.num_accepted.tolist() == [0] * 5
    assert bool(dense.bonus.all())


def test_shape_asserts():
    logits = forced_logits([[1, 2, 3]])
    with pytest.raises(AssertionError):  # k from logits is 2, proposal has 3 slots
        rejection_sample(logits, one_hot_proposal([[1, 2, 3]]), [GREEDY], [None])
    with pytest.raises(AssertionError):  # num_draft beyond k
        rejection_sample(logits, one_hot_proposal([[1, 2]]), [GREEDY], [None], [3])
    with pytest.raises(AssertionError):  # one SamplingParams per sequence
        rejection_sample(logits, one_hot_proposal([[1, 2]]), [GREEDY, GREEDY], [None])


def naive_greedy(logits: list[list[float]], drafts: list[int], num_draft: int) -> list[int]:
    """Plain greedy decoding, one row at a time (first index wins ties, like argmax)."""
    out = []
    for j in range(num_draft + 1):
        row = logits[j]
        top = max(range(len(row)), key=row.__getitem__)
        if j == num_draft or drafts[j] != top:
            return out + [top]
        out.append(drafts[j])
    raise AssertionError("unreachable")


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 4),
    k=st.integers(0, 5),
    vocab=st.integers(2, 12),
    match=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_greedy_equals_naive_loop(n, k, vocab, match, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(-2, 3, (n, k + 1, vocab), generator=g).float()  # ties on purpose
    top = logits.argmax(-1)
    noise = torch.randint(0, vocab, (n, k), generator=g)
    tokens = torch.where(torch.rand(n, k, generator=g) < match, top[:, :k], noise)
    num_draft = torch.randint(0, k + 1, (n,), generator=g).tolist()
    result = rejection_sample(logits, one_hot_proposal(tokens), [GREEDY] * n, [None] * n, num_draft)
    for i in range(n):
        assert result.committed[i] == naive_greedy(
            logits[i].tolist(), tokens[i].tolist(), num_draft[i]
        )
    check_consistent(result, tokens, num_draft)


# ---------------------------------------------------------------- random path: distribution


def make_q(vocab: int, support: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random proposal truncated to ``support`` tokens: (ids [support], probs [support])."""
    dense = torch.softmax(torch.randn(vocab, generator=g) * 1.5, -1)
    probs, ids = dense.topk(support)
    return ids, probs / probs.sum()


def first_emitted_pdf(
    logits: torch.Tensor,  # [vocab]: target logits at row 0 (shared by every sample)
    q_ids: torch.Tensor,  # [K_q]
    q_probs: torch.Tensor,  # [K_q]
    params: SamplingParams,
    num_samples: int,
) -> torch.Tensor:
    """Empirical distribution ``[vocab]`` of the first emitted token of a k=1 round."""
    vocab = logits.shape[-1]
    drafts = q_ids[torch.multinomial(q_probs, num_samples, replacement=True)]  # [N] ~ q
    proposal = Proposal(
        drafts[:, None],
        q_ids.expand(num_samples, 1, -1),
        q_probs.expand(num_samples, 1, -1),
    )
    target_logits = logits.expand(num_samples, 2, vocab)  # [N, 2, vocab]
    result = rejection_sample(target_logits, proposal, [params] * num_samples, [None] * num_samples)
    first = torch.where(result.num_accepted > 0, drafts, result.output_token)  # [N]
    return torch.bincount(first, minlength=vocab).float() / num_samples


@pytest.mark.parametrize("support", [10, 4, 1], ids=["dense_q", "sparse_q", "one_hot_q"])
def test_rejection_sampling_approximates_target_distribution(support):
    """The emitted token converges to p as samples grow, and not to random references."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    vocab = 10
    params = SamplingParams(temperature=1.0)
    logits = torch.randn(vocab, generator=g) * 1.5
    p = target_probs(logits[None], 1.0, 0, 1.0)[0]
    q_ids, q_probs = make_q(vocab, support, g)
    references = torch.softmax(torch.randn(100, vocab, generator=g) * 1.5, -1)  # [100, vocab]

    dist_target, dist_reference = [], []
    for num_samples in [10, 100, 1_000, 10_000, 100_000]:
        pdf = first_emitted_pdf(logits, q_ids, q_probs, params, num_samples)
        dist_target.append(tv(pdf, p))
        dist_reference.append(tv(pdf, references))  # nearest of the random references

    assert dist_target[-1] < 0.01
    assert dist_target[-1] < dist_target[2] < dist_target[0]
    assert dist_target[-1] < dist_reference[-1] / 5
    improvement_target = dist_target[0] / dist_target[-1]
    improvement_reference = dist_reference[0] / dist_reference[-1]
    assert improvement_target > 20 * improvement_reference


# chi-square critical value for df = 24 (a 5 x 5 table) at alpha = 0.001
CHI2_DF24_P001 = 51.18


@pytest.mark.parametrize("support", [5, 2], ids=["dense_q", "sparse_q"])
def test_joint_distribution_of_two_tokens_k2(support):
    """The first two emitted tokens (k=2, across rounds when needed) follow p exactly.

    The target is a Markov chain: after token c it samples from ``p[c]``; the drafter
    proposes from its own chain ``q[c]``, truncated to ``support`` tokens. A round that
    rejects its first draft emits one token, so those sequences run a second round.
    """
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    vocab, num_samples, start = 5, 40_000, 0
    params = SamplingParams(temperature=0.8)
    target_logits = torch.randn(vocab, vocab, generator=g)  # [c, vocab]: logits after token c
    p = target_probs(target_logits, 0.8, 0, 1.0)  # [c, vocab]
    q_rows = [make_q(vocab, support, g) for _ in range(vocab)]
    q_ids = torch.stack([ids for ids, _ in q_rows])  # [c, K_q]
    q_probs = torch.stack([probs for _, probs in q_rows])  # [c, K_q]
    q_dense = torch.zeros(vocab, vocab).scatter_(1, q_ids, q_probs)  # [c, vocab]

    def one_round(context: torch.Tensor) -> tuple[RejectionResult, torch.Tensor]:
        d1 = torch.multinomial(q_dense[context], 1).squeeze(1)
        d2 = torch.multinomial(q_dense[d1], 1).squeeze(1)
        prev = torch.stack([context, d1], 1)  # [N, 2]: the token each draft follows
        proposal = Proposal(torch.stack([d1, d2], 1), q_ids[prev], q_probs[prev])
        logits = target_logits[torch.stack([context, d1, d2], 1)]  # [N, 3, vocab]
        n = len(context)
        return rejection_sample(logits, proposal, [params] * n, [None] * n), proposal.tokens

    first_round, drafts = one_round(torch.full((num_samples,), start))
    committed = first_round.committed
    first = torch.tensor([c[0] for c in committed])
    second = torch.tensor([c[1] if len(c) > 1 else -1 for c in committed])
    again = (second < 0).nonzero().squeeze(1)
    second_round, _ = one_round(first[again])
    second[again] = torch.tensor([c[0] for c in second_round.committed], dtype=torch.long)

    expected = num_samples * (p[start][:, None] * p).flatten()  # [vocab * vocab]

    def chi2(a: torch.Tensor, b: torch.Tensor) -> float:
        counts = torch.bincount(a * vocab + b, minlength=vocab * vocab).float()
        return float(((counts - expected) ** 2 / expected).sum())

    assert chi2(first, second) < CHI2_DF24_P001
    # the test has power: the drafter's own joint fails it by a wide margin
    assert chi2(drafts[:, 0], drafts[:, 1]) > 10 * CHI2_DF24_P001


@pytest.mark.parametrize("top_k,top_p", [(1, 1.0), (3, 1.0), (0, 0.6), (5, 0.8)])
def test_top_k_top_p(top_k, top_p):
    """Emitted tokens stay inside the processed support, and follow the processed p."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    vocab, n, k = 20, 200, 3
    params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)

    # support: every committed token j lies in the support of p at row j
    logits = torch.randn(n, k + 1, vocab, generator=g) * 2  # [n, k + 1, vocab]
    p = target_probs(logits.view(-1, vocab), 1.0, top_k, top_p).view(n, k + 1, vocab)
    q = torch.softmax(torch.randn(n, k, vocab, generator=g), -1)  # dense, full-vocab q
    drafts = torch.multinomial(q.view(-1, vocab), 1).view(n, k)
    ids = torch.arange(vocab).expand(n, k, vocab)
    result = rejection_sample(logits, Proposal(drafts, ids, q), [params] * n, [None] * n)
    for i, committed in enumerate(result.committed):
        for j, tok in enumerate(committed):
            assert p[i, j, tok] > 0, (i, j, tok)
    check_consistent(result, drafts, [k] * n)

    # distribution of the first emitted token (k=1) against the processed p
    row = torch.randn(vocab, generator=g) * 2
    q_ids, q_probs = make_q(vocab, 8, g)
    pdf = first_emitted_pdf(row, q_ids, q_probs, params, 50_000)
    expected = target_probs(row[None], 1.0, top_k, top_p)[0]
    assert pdf[expected == 0].sum() == 0
    assert tv(pdf, expected) < 0.015


# ---------------------------------------------------------------- seeding and mixed batches


def make_batch(num: int, k: int, vocab: int, seed: int):
    """Random logits, sparse proposals and ragged num_draft for ``num`` sequences."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num, k + 1, vocab, generator=g)  # [num, k + 1, vocab]
    q = torch.softmax(torch.randn(num, k, vocab, generator=g) * 2, -1)
    q_probs, q_ids = q.topk(6)  # [num, k, 6]
    q_probs = q_probs / q_probs.sum(-1, keepdim=True)
    pick = torch.multinomial(q_probs.view(-1, 6), 1).view(num, k, 1)
    tokens = q_ids.gather(-1, pick).squeeze(-1)  # [num, k]
    num_draft = torch.randint(0, k + 1, (num,), generator=g).tolist()
    return logits, Proposal(tokens, q_ids, q_probs), num_draft


def run_subset(batch, params, order: list[int]) -> dict[int, list[int]]:
    """Run the sequences ``order`` (indices into ``batch``) with fresh generators."""
    logits, proposal, num_draft = batch
    idx = torch.tensor(order)
    sub = Proposal(proposal.tokens[idx], proposal.q_ids[idx], proposal.q_probs[idx])
    result = rejection_sample(
        logits[idx],
        sub,
        [params[i] for i in order],
        [params[i].generator() for i in order],
        [num_draft[i] for i in order],
    )
    return dict(zip(order, result.committed, strict=True))


def test_seeded_determinism_across_batch_and_order():
    """A seeded sequence commits the same tokens whatever shares its batch, in any order."""
    k, vocab, num = 4, 50, 16
    batch = make_batch(num, k, vocab, seed=4)
    params = [
        SamplingParams(temperature=t, top_k=tk, top_p=tp, seed=s)
        for t, tk, tp, s in [
            (1.0, 0, 1.0, 11),
            (0.7, 10, 1.0, 12),
            (1.3, 0, 0.9, 13),
            (0.0, 0, 1.0, None),
            (1.0, 5, 0.8, 14),
            (0.5, 0, 1.0, 15),
        ]
    ]
    params += [SamplingParams(temperature=1.0)] * (num - len(params))  # unseeded filler
    seeded = [i for i, sp in enumerate(params) if sp.seed is not None]

    torch.manual_seed(0)
    full = run_subset(batch, params, list(range(num)))
    reordered = run_subset(batch, params, list(reversed(range(num))))
    shuffled = run_subset(batch, params, torch.randperm(num).tolist())
    for i in seeded:
        alone = run_subset(batch, params, [i])
        assert full[i] == reordered[i] == shuffled[i] == alone[i], i
    greedy = params.index(SamplingParams())
    assert full[greedy] == reordered[greedy] == run_subset(batch, params, [greedy])[greedy]


def test_plain_step_matches_sample_next():
    """num_draft = 0 samples row 0 exactly like plain decoding, from the same generator."""
    logits, proposal, _ = make_batch(8, 3, 50, seed=5)
    params = [SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=s) for s in range(8)]
    params[3] = SamplingParams()
    result = rejection_sample(logits, proposal, params, [sp.generator() for sp in params], [0] * 8)
    for i, sp in enumerate(params):
        assert result.committed[i] == [sample_next(logits[i, 0], sp, sp.generator())]
    assert result.bonus.all() and (result.num_accepted == 0).all()


def test_mixed_batch_greedy_results_unchanged():
    """Greedy sequences give their plain greedy result next to sampled ones."""
    logits, proposal, num_draft = make_batch(10, 3, 50, seed=6)
    top = logits.argmax(-1)
    proposal.tokens[::2] = top[::2, :3]  # even sequences: drafts the greedy target accepts
    params = [GREEDY if i % 2 == 0 else SamplingParams(temperature=1.0) for i in range(10)]
    result = rejection_sample(logits, proposal, params, [None] * 10, num_draft)
    for i in range(0, 10, 2):
        assert result.committed[i] == top[i, : num_draft[i] + 1].tolist()
        assert result.bonus[i]
    check_consistent(result, proposal.tokens, num_draft)


def test_ragged_logits_give_the_dense_result():
    """The target's ragged rows (``num_draft + 1`` per sequence, unpadded) verify exactly
    as the padded ``[n, k + 1, vocab]`` tensor does: greedy, sampled and seeded alike."""
    logits, proposal, num_draft = make_batch(12, 5, 40, seed=9)
    num_draft[0], num_draft[1] = 0, 5  # a plain row and a full block among them
    params = [
        GREEDY if i % 3 == 0 else SamplingParams(temperature=0.8, top_k=20, seed=i)
        for i in range(12)
    ]
    ragged = torch.cat([logits[i, : d + 1] for i, d in enumerate(num_draft)])
    dense = rejection_sample(logits, proposal, params, [p.generator() for p in params], num_draft)
    flat = rejection_sample(ragged, proposal, params, [p.generator() for p in params], num_draft)
    assert flat.committed == dense.committed
    assert torch.equal(flat.num_accepted, dense.num_accepted)
    assert torch.equal(flat.bonus, dense.bonus)
    with pytest.raises(AssertionError, match="logit rows"):
        rejection_sample(ragged[1:], proposal, params, [None] * 12, num_draft)
