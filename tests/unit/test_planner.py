"""The round planner's two hooks on their own: what it plans, and what it learns."""

from __future__ import annotations

from services.engine.adaptive.copies import CopyPlan
from services.engine.adaptive.planner import RoundPlanner
from services.engine.metrics import EngineStats
from services.engine.params import SamplingParams
from services.engine.sequence import Sequence
from services.engine.stopping import StopChecker


def seq(seq_id: int, max_tokens: int = 50, output: int = 3, **params) -> Sequence:
    sp = SamplingParams(max_tokens=max_tokens, **params)
    s = Sequence(seq_id, f"r{seq_id}", [1, 2, 3], sp, StopChecker((), max_tokens))
    s.output_ids = [4] * output
    return s


class Idle:
    """A policy that chose plain rounds long enough to put the drafter aside."""

    idle = True

    def choose(self, batch: int) -> int:
        return 0

    def explore_next(self) -> None:
        self.explored = True

    def probe_interval(self, batch: int, floor: int) -> float:
        return floor


def test_fixed_k_never_drafts_past_max_tokens_or_for_lost_or_plain_sequences():
    planner = RoundPlanner(k=5, max_len=100, stats=EngineStats(), drafter=True)
    running = [seq(0), seq(1, max_tokens=5), seq(2), seq(3)]
    planner.go_plain([2])
    plan = planner.plan(running, drafting=lambda seq_id: seq_id != 3)
    assert plan.num_draft == [5, 1, 0, 0] and plan.put_aside == [] and plan.copies == []
    assert RoundPlanner(5, 100, EngineStats(), drafter=False).plan(running).num_draft == [0] * 4


def test_an_idle_policy_puts_the_drafter_aside_but_seeded_sampling_keeps_k():
    stats = EngineStats()
    planner = RoundPlanner(k=4, max_len=100, stats=stats, drafter=True, adaptive=True)
    planner.policy = Idle()
    seeded = seq(1, temperature=1.0, seed=3)
    plan = planner.plan([seq(0), seeded])
    assert plan.put_aside == [0] and plan.num_draft == [0, 4]  # the seeded one keeps k
    assert planner.asleep and stats.drafter_sleeps == 1
    assert planner.release([0, 1]) == [1]  # only the seeded one still has drafter state


def test_while_aside_new_sequences_start_plain_except_a_probe_now_and_then():
    stats = EngineStats()
    planner = RoundPlanner(4, 100, stats, drafter=True, adaptive=True, probe_every=3)
    planner.policy = Idle()
    planner.plan([seq(0)])
    admitted = []
    for i in range(1, 5):
        planner.plan([seq(0)])
        admitted.append(planner.admit([seq(i)], batch=2))
    assert admitted == [False, True, False, False]  # one probe batch every 3 rounds
    assert stats.drafter_probes == 1 and planner.policy.explored


class PaysAtOne:
    """A policy awake, whose measurements say drafting pays at batch size 1 only."""

    idle = False

    def choose(self, batch: int) -> int:
        return 4 if batch == 1 else 0

    def pays_at(self, batch: int) -> bool:
        return batch == 1

    def explore_next(self) -> None:
        self.explored = True

    def probe_interval(self, batch: int, floor: int) -> float:
        return floor


def test_sequences_admitted_where_drafting_loses_start_plain_except_a_probe_now_and_then():
    stats = EngineStats()
    planner = RoundPlanner(4, 100, stats, drafter=True, adaptive=True, probe_every=3)
    planner.policy = PaysAtOne()
    assert planner.admit([seq(0)], batch=1)  # alone: drafting pays
    admitted = []
    for i in range(1, 5):
        planner.plan([seq(0), seq(9)])
        admitted.append(planner.admit([seq(i)], batch=3))
    assert admitted == [False, False, True, False]  # a probe after 3 rounds without one
    assert stats.drafter_probes == 1 and planner.policy.explored
    seeded = seq(7, temperature=1.0, seed=3)  # seeded sampling keeps a fixed k: it needs state
    assert planner.admit([seeded], batch=3)
    assert not planner.asleep and planner.plan([seq(0)]).put_aside == []


def test_an_exploration_copy_is_drafted_but_not_priced_into_the_plain_option():
    planner = RoundPlanner(4, 100, EngineStats(), drafter=True, adaptive=True, copy_drafts=True)
    running = [seq(0, output=8), seq(1, output=8)]  # "4 4 4 ...": a sure copy of 4s each
    planner.copier.plan = lambda candidates, batch, verify: CopyPlan([], candidates[:1])
    explored = planner.plan(running, waiting=True).copies
    assert len(explored) == 1 and explored[0].tokens == [4] * 4
    assert planner.policy.plain_rows == 1.0 and planner.policy.plain_tokens == 1.0
    planner.copier.plan = lambda candidates, batch, verify: CopyPlan(candidates[:1])
    assert planner.plan(running, waiting=True).copies == explored
    assert planner.policy.plain_rows == 1.0 + 4 / 2  # a copy worth its rows is priced


def test_copies_only_while_one_sequence_runs_or_requests_wait():
    """With every request running, a copy's early finish frees a slot nobody takes: no
    copies (and no search for them). Alone, or with a queue, the copier decides."""
    planner = RoundPlanner(4, 100, EngineStats(), drafter=True, adaptive=True, copy_drafts=True)
    searched = []
    planner.copier.plan = lambda candidates, batch, verify: (
        searched.append(batch) or CopyPlan(candidates)
    )
    two = [seq(0, output=8), seq(1, output=8)]
    assert planner.plan(two).copies == [] and searched == []
    assert planner.policy.plain_rows == 1.0 and planner.policy.plain_tokens == 1.0
    assert len(planner.plan(two, waiting=True).copies) == 2 and searched == [2]
    assert len(planner.plan(two[:1]).copies) == 1 and searched == [2, 1]
