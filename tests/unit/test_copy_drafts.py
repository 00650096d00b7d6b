"""Engine-side context copies: which copies a round drafts, and that output stays exact."""

from __future__ import annotations

import pytest
import torch

from services.engine.adaptive.copies import (
    CopyCandidate,
    CopyPlanner,
    copy_proposal,
    find_candidate,
)
from services.engine.adaptive.ngram_index import NgramIndex
from services.engine.adaptive.policy import LinearCost, SpecPolicy
from services.engine.core import Engine, EngineConfig
from services.engine.params import SamplingParams
from target_actor.runner import TargetSpec
from target_actor.worker import LocalTarget
from tests.unit.test_engine import ByteTokenizer, prompts, random_drafter
from tests.unit.test_spec_policy import Scripted


def cost(a: float, b: float) -> LinearCost:
    line = LinearCost()
    for rows in (1, 8, 32, 64):
        line.observe(rows, a + b * rows)
    return line


def test_candidate_is_the_sure_copy_capped_at_the_limit():
    ids = [5, 6, 7, 8, 9, 1, 5, 6]  # anchor 6 after 5: "5 6" matched, "7 8 9 ..." follows
    index, short = NgramIndex(), NgramIndex()
    index.sync(ids[:3], ids[3:])
    assert find_candidate(3, index, limit=2, sampled=False) == CopyCandidate(3, [7, 8], (2, False))
    short.sync([5, 6, 7, 1, 6], [])
    assert find_candidate(0, short, 4, False) is None  # a 1-token match: not sure
    assert find_candidate(0, index, 0, False) is None  # no room left to draft


def test_planner_drafts_every_copy_when_rows_are_nearly_free_and_only_sure_ones_when_not():
    long_ = CopyCandidate(0, [1] * 7, (8, False))
    short = CopyCandidate(1, [2] * 7, (2, False))
    planner = CopyPlanner(7, explore_every=10**9)
    for _ in range(200):  # 8-token matches hold whole; 2-token ones fail at once
        planner.observe([long_, short], [7, 0])
    memory_bound = cost(0.040, 0.0001)
    assert planner.plan([long_, short], 1, memory_bound).copies == [long_]  # a failing copy
    short_acc = planner.acceptance[(2, False)]
    short_acc.accepts[0] = short_acc.trials[0]  # now its first slot always holds
    drafted = planner.plan([long_, short], 1, memory_bound).copies
    # rows nearly free: the short copy drafts too, but for slots 1 in 64 would hold
    assert drafted[0] == long_ and drafted[1].row == 1 and len(drafted[1].tokens) == 6
    compute_bound = cost(0.010, 0.004)  # a row costs most of a plain step: near-certain only
    # the short match's first slot always holds, its second as often as not: one token
    assert planner.plan([long_, short], 32, compute_bound).copies == [
        long_,
        CopyCandidate(1, [2], (2, False)),
    ]


def test_a_copy_keeps_the_slots_whose_chance_beats_what_a_row_costs():
    copy = CopyCandidate(0, [3] * 7, (3, False))
    planner = CopyPlanner(7, explore_every=10**9)
    for _ in range(300):  # the first two slots hold, the third fails
        planner.observe([copy], [2])
    assert planner._worth(copy, price=0.5) == CopyCandidate(0, [3, 3], (3, False))
    assert planner._worth(copy, price=0.999) is None  # no slot is that sure
    exact = planner.plan([copy], 1, cost(0.004, 0.0005)).copies
    assert exact == [CopyCandidate(0, [3, 3], (3, False))]


def explorer(budget: float) -> tuple[CopyPlanner, CopyCandidate, CopyCandidate]:
    """A planner exploring every 3 rounds at least, which knows one candidate fails."""
    known = CopyCandidate(0, [1] * 7, (2, False))
    unknown = CopyCandidate(1, [1] * 7, (5, False))
    planner = CopyPlanner(7, explore_every=3, explore_budget=budget)
    for _ in range(100):
        planner.observe([known], [0])
    return planner, known, unknown


def test_planner_explores_the_least_known_candidate_now_and_then():
    planner, known, unknown = explorer(budget=1.0)
    plans = [planner.plan([known, unknown], 32, cost(0.0, 0.005)) for _ in range(6)]
    assert [p.explore for p in plans] == [[], [], [unknown], [], [], [unknown]]
    assert all(p.worth == [] for p in plans)  # drafted, but not as a copy worth its rows


def test_exploring_costs_at_most_its_budget_of_the_time():
    planner, known, unknown = explorer(budget=0.02)
    verify = cost(0.0, 0.005)  # 7 extra rows on 32: +22% of a round, so 1 round in 11
    explored = [i for i in range(1, 45) if planner.plan([known, unknown], 32, verify).explore]
    assert explored == [11, 22, 33, 44]


def test_copy_proposal_is_one_hot_on_the_copied_tokens():
    drafted = [CopyCandidate(2, [4, 5, 6], (3, True)), CopyCandidate(0, [9], (2, False))]
    num_draft, p = copy_proposal(drafted, 3)
    assert num_draft == [1, 0, 3]
    assert p.tokens[2].tolist() == [4, 5, 6] and p.tokens[0, 0] == 9
    assert torch.equal(p.q_ids[2, :, 0], p.tokens[2]) and torch.all(p.q_probs == 1.0)


def test_policy_prices_a_round_of_copies_as_its_plain_option():
    policy = SpecPolicy(k_max=7)
    linear = lambda rows: 0.040 + 0.006 * rows  # noqa: E731 - 8 rows: about 2 plain steps
    for _ in range(40):  # the network's drafts: about 3 tokens a round
        k = policy.choose(1)
        policy.observe([k], [2 if k else 0], 0.004 if k else 0.0, linear(k + 1), bool(k))
    policy.since_other = 0
    assert policy.choose(1) == 7  # plain decoding (1 token a round) loses to the network
    policy.plain_tokens, policy.plain_rows = 4.0, 8.0  # this round has a long sure copy
    assert policy.choose(1) == 0
    policy.observe([7], [2], 0.0, linear(8), network=False)
    assert policy.accepted.trials[3] < 1.0  # copies never count as the network's drafts


def test_copies_are_priced_by_the_rounds_without_the_network_once_their_rows_vary():
    policy = SpecPolicy(k_max=7)
    for _ in range(20):  # full blocks: 256 rows at 0.7 s; plain rounds: 32 rows at 0.214 s
        policy.observe([7] * 32, [2] * 32, 0.01, 0.710)
        policy.observe([0] * 32, [0] * 32, 0.0, 0.214, network=False)
    shared = policy.verify.predict(33) - policy.verify.predict(32)
    assert policy.plain_cost() is policy.verify  # plain rows never varied: the shared line
    for _ in range(20):  # rounds with one 7-token copy: 39 rows at 0.240 s (3.7 ms a row)
        policy.observe([7] + [0] * 31, [3] + [0] * 31, 0.0, 0.240, network=False)
    local = policy.plain_cost()
    assert local is policy.plain_verify
    assert local.predict(33) - local.predict(32) == pytest.approx(0.026 / 7, rel=0.01)
    assert shared == pytest.approx(0.496 / 224, rel=0.01)  # the line over both: 2.2 ms a row
    assert policy.round_seconds(32, 0) == pytest.approx(0.214, rel=0.01)


class AlwaysPlain(Scripted):
    def choose(self, batch: int) -> int:
        return 0


def test_copy_rounds_equal_plain_decoding_and_keep_the_drafter_in_sync(tiny_checkpoints):
    """Repetitive prompts: engine copies happen in plain rounds, output equals plain
    decoding, and the drafter's views stay current for the network rounds in between."""
    path = tiny_checkpoints["llama"]
    ps = [p * 3 for p in prompts(6, 4)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = Engine(
        LocalTarget(TargetSpec(str(path), kv_cache_tokens=4096)), ByteTokenizer()
    ).generate(ps, params)
    for policy in (AlwaysPlain(4), Scripted(4)):
        engine = Engine(
            LocalTarget(TargetSpec(str(path), kv_cache_tokens=4096)),
            ByteTokenizer(),
            random_drafter(path, k=4),
            # two at a time, the rest waiting: the planner copies only while requests wait
            # or one runs alone
            EngineConfig(k=4, adaptive=True, copy_drafts=True, max_num_seqs=2),
        )
        engine.planner.policy = policy
        outs = engine.generate(ps, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
        assert engine.stats.copy_drafts > 0
        assert engine.drafter.num_states() == 0


def test_copies_off_by_default_and_without_the_adaptive_policy(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    target = LocalTarget(TargetSpec(str(path), kv_cache_tokens=1024))
    drafter = random_drafter(path, k=4)
    assert (
        Engine(target, ByteTokenizer(), drafter, EngineConfig(k=4, adaptive=True)).planner.copier
        is None
    )
    fixed = Engine(target, ByteTokenizer(), drafter, EngineConfig(k=4, copy_drafts=True))
    assert fixed.planner.copier is None
