"""The adaptive draft length: it speculates where drafting pays and stays lossless."""

from __future__ import annotations

import math
import random

import pytest

from services.engine.adaptive.policy import (
    KEPT,
    NETWORK,
    PLAIN,
    LinearCost,
    RealizedRate,
    SpecPolicy,
)
from services.engine.core import Engine, EngineConfig
from services.engine.params import SamplingParams
from target_actor.runner import TargetSpec
from target_actor.worker import LocalTarget
from tests.unit.test_engine import ByteTokenizer, prompts, random_drafter


def feed(policy: SpecPolicy, batch: int, k: int, accepted: int, verify, draft) -> None:
    """One simulated round of ``batch`` sequences, each accepting ``accepted`` of ``k``."""
    rows = batch * (k + 1)
    policy.observe(
        [k] * batch, [min(accepted, k)] * batch, draft(rows) if k else 0.0, verify(rows), bool(k)
    )  # a round with k = 0 ran without the network, as the engine reports it


def test_linear_cost_recovers_a_line_and_is_flat_with_one_row_count():
    cost = LinearCost()
    cost.observe(8, 0.044)
    assert cost.predict(64) == pytest.approx(0.044)  # one row count: flat
    for rows in (1, 8, 16, 64, 1, 8):
        cost.observe(rows, 0.030 + 0.002 * rows)
    assert cost.predict(32) == pytest.approx(0.030 + 0.002 * 32, rel=0.05)


def test_high_acceptance_and_memory_bound_verify_speculate_fully():
    policy = SpecPolicy(k_max=7)
    flat = lambda rows: 0.030 + 0.0002 * rows  # noqa: E731 - a verify block costs ~ one step
    for _ in range(40):
        k = policy.choose(1)
        feed(policy, 1, k, accepted=7, verify=flat, draft=lambda rows: 0.005)
    assert policy.choose(1) == 7
    assert policy.expected_tokens(7) > 5


def useless_drafting(budget: float, rounds: int) -> list[int]:
    """The k chosen, round by round, at C=4 when no draft is ever accepted and a drafted
    round costs ~3x a plain one."""
    policy = SpecPolicy(k_max=7, explore_every=8, explore_budget=budget)
    verify = lambda rows: 0.030 + 0.002 * rows  # noqa: E731
    chosen = []
    for _ in range(rounds):
        k = policy.choose(4)
        chosen.append(k)
        feed(policy, 4, k, accepted=0, verify=verify, draft=lambda rows: 0.010)
    return chosen


def test_useless_drafts_switch_speculation_off_and_exploration_checks_back():
    tail = useless_drafting(budget=1.0, rounds=60)[20:]
    assert tail.count(0) > 0.8 * len(tail)  # mostly plain rounds
    assert any(k == 7 for k in tail)  # but it keeps probing


def test_a_dear_alternative_is_explored_within_the_budget():
    """Drafted rounds at 3x a plain round's cost: tried every ~100 rounds, not every 8."""
    chosen = useless_drafting(budget=0.02, rounds=400)
    tries = [i for i, k in enumerate(chosen) if k and i >= 20]
    assert 1 <= len(tries) <= 6  # (0.104 / 0.038 - 1) / 0.02 ~ 87 rounds apart
    spent = sum(0.104 - 0.038 for _ in tries) / (380 * 0.038)
    assert spent <= 0.03


def test_compute_bound_large_batches_draft_less_than_small_ones():
    rng = random.Random(0)
    policy = SpecPolicy(k_max=7, explore_every=1000)
    cost = lambda rows: 0.030 + 0.004 * rows  # noqa: E731 - every row costs (compute-bound)
    for batch in (1, 32) * 10:
        for k in (0, 7):
            accepted = [geometric(rng, 0.6, k) for _ in range(batch)]
            rows = batch * (k + 1)
            policy.observe([k] * batch, accepted, 0.002 if k else 0.0, cost(rows), bool(k))
    assert 0.5 < policy.acceptance()[0] < 0.7
    assert policy.choose(1) > 0  # C=1: a verify block is cheap, speculate
    assert policy.choose(32) == 0  # C=32: k+1 rows per sequence cost k+1 steps, do not
    # what the engine asks before it gives new sequences drafter state
    assert policy.pays_at(1) and not policy.pays_at(32)
    assert SpecPolicy(k_max=7).pays_at(32)  # nothing measured: speculate, which measures


def geometric(rng: random.Random, alpha: float, k: int) -> int:
    """Accepted drafts when each is accepted with probability ``alpha`` until one is not."""
    m = 0
    while m < k and rng.random() < alpha:
        m += 1
    return m


class Scripted(SpecPolicy):
    """A policy that alternates plain and drafting rounds, to exercise both paths."""

    def choose(self, batch: int) -> int:
        self.last_k = 0 if self.last_k else self.k_max
        return self.last_k


def spec_engine(path, config: EngineConfig) -> Engine:
    """A spec engine on the tiny model with a random drafter (k = 4)."""
    return Engine(
        LocalTarget(TargetSpec(str(path), kv_cache_tokens=4096)),
        ByteTokenizer(),
        random_drafter(path, k=4),
        config,
    )


def plain_and_adaptive(path, ps: list[list[int]], params: SamplingParams) -> tuple[list, Engine]:
    """Plain decoding's outputs, and an adaptive spec engine (random drafter) to compare."""
    plain = Engine(
        LocalTarget(TargetSpec(str(path), kv_cache_tokens=4096)), ByteTokenizer()
    ).generate(ps, params)
    return plain, spec_engine(path, EngineConfig(k=4, adaptive=True))


def test_mixed_plain_and_spec_rounds_keep_output_and_drafter_in_sync(tiny_checkpoints):
    ps, params = prompts(5, 3), SamplingParams(max_tokens=24, ignore_eos=True)
    plain, engine = plain_and_adaptive(tiny_checkpoints["llama"], ps, params)
    assert engine.planner.policy is not None
    engine.planner.policy = Scripted(4)
    outs = engine.generate(ps, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert engine.stats.spec.num_drafts > 0
    assert engine.drafter.num_states() == 0  # every state freed


def test_adaptive_engine_is_lossless_with_a_random_drafter(tiny_checkpoints):
    ps, params = prompts(6, 4), SamplingParams(max_tokens=30, ignore_eos=True)
    plain, engine = plain_and_adaptive(tiny_checkpoints["qwen3"], ps, params)
    outs = engine.generate(ps, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


def test_seeded_sampled_requests_keep_a_fixed_k_so_the_seed_reproduces(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    ps = prompts(3, 5)
    params = [SamplingParams(max_tokens=20, temperature=0.9, seed=11 + i) for i in range(3)]
    fixed = spec_engine(path, EngineConfig(k=4)).generate(ps, params)
    _, adaptive = plain_and_adaptive(path, ps[:1], SamplingParams(max_tokens=1))
    adaptive.planner.policy = Scripted(4)  # would alternate plain and drafting rounds
    outs = adaptive.generate(ps, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in fixed]


def test_policy_is_idle_after_plain_rounds_win_in_a_row_and_not_once_drafting_pays():
    policy = SpecPolicy(k_max=7, explore_every=8, sleep_after=10)
    linear = lambda rows: 0.030 + 0.002 * rows  # noqa: E731
    for _ in range(40):
        feed(policy, 4, policy.choose(4), accepted=0, verify=linear, draft=lambda r: 0.010)
    assert policy.idle
    for _ in range(40):  # drafts start being accepted: the estimate recovers, k > 0 wins
        feed(policy, 4, 7, accepted=7, verify=linear, draft=lambda r: 0.001)
    policy.choose(4)
    assert not policy.idle


def test_drafter_put_aside_when_it_does_not_pay_stays_lossless_and_probes(tiny_checkpoints):
    """A random drafter never pays: the engine drops its states, probes now and then with a
    new sequence, and every output still equals plain decoding; nothing leaks."""
    path = tiny_checkpoints["llama"]
    ps, params = prompts(8, 6), SamplingParams(max_tokens=40, ignore_eos=True)
    plain = Engine(
        LocalTarget(TargetSpec(str(path), kv_cache_tokens=4096)), ByteTokenizer()
    ).generate(ps, params)
    engine = spec_engine(path, EngineConfig(k=4, adaptive=True, max_num_seqs=2, probe_every=12))
    # probe_budget 1: probes every probe_every rounds, however dear (the interval's own test
    # is below)
    engine.planner.policy = SpecPolicy(4, explore_every=6, sleep_after=5, probe_budget=1.0)
    states_while_aside = []
    real_step = engine.step

    def step() -> None:
        real_step()
        if engine.planner.asleep:
            states_while_aside.append(engine.drafter.num_states())

    engine.step = step
    outs = engine.generate(ps, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    s = engine.stats.summary()
    assert s["drafter_sleeps"] >= 1 and s["drafter_probes"] >= 1
    assert states_while_aside and min(states_while_aside) == 0  # no state kept while aside
    assert engine.drafter.num_states() == 0 and engine.target.kv_stats()["num_seqs"] == 0
    assert not engine.planner.plain_only and not engine.planner.probes


def test_seeded_sampled_requests_keep_their_drafter_state_while_it_is_aside(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    ps = prompts(3, 7)
    params = [SamplingParams(max_tokens=30, temperature=0.9, seed=5 + i) for i in range(3)]
    fixed = spec_engine(path, EngineConfig(k=4)).generate(ps, params)
    engine = spec_engine(path, EngineConfig(k=4, adaptive=True, probe_every=4))
    engine.planner.policy = SpecPolicy(4, sleep_after=1)
    outs = engine.generate(ps, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in fixed]


def test_a_plain_round_is_measured_before_a_block_prices_it():
    """After the first full block at C=8 (64 rows) the verify line has one row count and
    would price a plain round of 8 rows like the block; the policy measures one first."""
    policy = SpecPolicy(k_max=7)
    verify = lambda rows: 0.010 + 0.0012 * rows  # noqa: E731
    assert policy.choose(8) == 7
    feed(policy, 8, 7, accepted=2, verify=verify, draft=lambda rows: 0.025)
    assert policy.choose(8) == 0
    feed(policy, 8, 0, accepted=0, verify=verify, draft=lambda rows: 0.0)
    assert policy.round_seconds(8, 0) == pytest.approx(verify(8), rel=0.01)
    assert policy.choose(8) == 0  # 3 tokens a sequence for 4.6x the time: plain wins


def test_a_probe_drafts_in_the_next_round_however_dear_drafting_is():
    policy = SpecPolicy(k_max=7, explore_every=8, explore_budget=0.02)
    verify = lambda rows: 0.030 + 0.002 * rows  # noqa: E731
    for _ in range(40):  # nothing accepted: plain rounds, drafts tried every ~87 rounds
        k = policy.choose(4)
        feed(policy, 4, k, accepted=0, verify=verify, draft=lambda rows: 0.010)
    assert policy.choose(4) == 0
    policy.explore_next()  # a probe sequence joined
    assert policy.choose(4) == 7
    assert policy.choose(4) == 0


def test_a_long_plain_phase_keeps_the_price_of_a_drafted_round():
    """Hundreds of plain rounds at one batch size forget the drafted rounds' row counts;
    the verify line keeps the slope it last measured, so drafting still costs its rows
    there (before, the policy took the flat line for "nothing measured": it admitted new
    sequences with drafter state and never drafted for them)."""
    policy = SpecPolicy(k_max=7)
    verify = lambda rows: 0.010 + 0.0012 * rows  # noqa: E731
    for k in (7, 0, 7, 0):
        feed(policy, 8, k, accepted=1, verify=verify, draft=lambda rows: 0.020)
    assert not policy.pays_at(8)
    for _ in range(400):
        feed(policy, 8, 0, accepted=0, verify=verify, draft=lambda rows: 0.0)
    assert policy.verify.spread < 1.0 and policy.verify.varied
    assert policy.round_seconds(8, 7) == pytest.approx(0.020 + verify(64), rel=0.05)
    assert not policy.pays_at(8)
    assert policy.choose(8) == 0


def test_probes_are_rarer_where_a_drafted_round_costs_several_plain_ones():
    policy = SpecPolicy(k_max=7, probe_budget=0.005)
    assert policy.probe_interval(16, 256) == 256  # nothing measured yet
    verify = lambda rows: 0.010 + 0.001 * rows  # noqa: E731
    for batch, k in [(1, 7), (1, 0), (16, 0), (16, 7)] * 4:
        feed(policy, batch, k, accepted=1, verify=verify, draft=lambda rows: 0.002)
    # one sequence: a drafted round (8 rows) 0.020 s against a plain one's 0.011
    assert policy.probe_interval(1, 256) == 256
    # sixteen: 0.138 + 0.002 s against 0.026 s, 4.4 plain rounds more: one in ~880 rounds
    assert policy.probe_interval(16, 256) == pytest.approx((0.140 / 0.026 - 1) / 0.005, rel=0.05)


def test_cost_per_sequence_is_told_apart_from_cost_per_row():
    """A server whose batch grew: drafted rounds seen at 1 sequence, plain and drafted ones
    at 8. Each sequence costs 2 ms (its K/V reads), each row 1 ms: at 8 sequences an 8-row
    plain round costs 26 ms, not the 18 ms an 8-row block of one sequence does."""
    cost = LinearCost()
    truth = lambda rows, seqs: 0.008 + 0.001 * rows + 0.002 * seqs  # noqa: E731
    for seqs, k in [(1, 7)] * 6 + [(8, 0), (8, 2), (4, 0), (8, 0)] * 3:
        cost.observe(seqs * (k + 1), truth(seqs * (k + 1), seqs), seqs)
    assert cost.slopes() == pytest.approx((0.001, 0.002), rel=1e-3)
    assert cost.predict(24, 8) == pytest.approx(truth(24, 8), rel=1e-3)


def misled_policy(realized_min: float) -> list[int]:
    """The k chosen at C=8 by a policy whose verify line still remembers an era in which
    rows cost next to nothing (so it prices drafting as cheap), while every row now costs
    4 ms: a drafted round (2 of 7 accepted) commits ~81 tokens/s, a plain one ~129."""
    policy = SpecPolicy(k_max=7, explore_every=8, explore_budget=1.0, realized_min=realized_min)
    policy.verify = LinearCost(decay=0.999)
    for _ in range(300):
        policy.verify.observe(1, 0.010)
        policy.verify.observe(8, 0.0101)
    verify = lambda rows: 0.030 + 0.004 * rows  # noqa: E731
    chosen = []
    for _ in range(80):
        k = policy.choose(8)
        chosen.append(k)
        feed(policy, 8, k, accepted=2, verify=verify, draft=lambda rows: 0.010)
    return chosen[-40:]


def test_drafting_that_realized_less_than_plain_rounds_stops_though_the_model_disagrees():
    assert misled_policy(realized_min=2).count(0) >= 30  # plain, but for explorations
    assert misled_policy(realized_min=math.inf).count(0) <= 10  # the model alone drafts


def test_drafting_that_lost_at_a_batch_size_is_not_tried_again_at_a_larger_one():
    policy = SpecPolicy(k_max=7)
    policy.realized = {(NETWORK, 4): RealizedRate(), (KEPT, 4): RealizedRate()}
    for _ in range(3):
        policy.realized[(NETWORK, 4)].observe(8, 0.1)  # 80 tokens/s with the network
        policy.realized[(KEPT, 4)].observe(4, 0.04)  # 100 without
    assert policy._drafting_lost(4) and policy._drafting_lost(9)
    assert not policy._drafting_lost(2)  # a smaller batch may still gain


def test_drafting_must_beat_plain_rounds_without_the_drafter_not_only_those_that_keep_it():
    """Keeping the drafter ready taxes every plain round (the target's taps, the drafter's
    updates); drafting that beats those taxed rounds but not the untaxed ones loses."""
    policy = SpecPolicy(k_max=7)
    rates = {NETWORK: (9, 0.1), KEPT: (8, 0.1), PLAIN: (10, 0.1)}  # tokens in 0.1 s
    policy.realized = {(kind, 1): RealizedRate() for kind in rates}
    for _ in range(3):
        for kind, (tokens, seconds) in rates.items():
            policy.realized[(kind, 1)].observe(tokens, seconds)
    assert policy._drafting_lost(1)
    del policy.realized[(PLAIN, 1)]  # never seen without the drafter: the kept rounds count
    assert not policy._drafting_lost(1)


def test_rounds_are_told_apart_by_whether_the_drafter_was_kept():
    policy = SpecPolicy(k_max=4)
    policy.observe([0, 0], [0, 0], 0.001, 0.010, network=False, taps=True)
    policy.observe([0, 0], [0, 0], 0.0, 0.009, network=False, taps=False)
    policy.observe([4, 4], [2, 1], 0.004, 0.020, network=True, taps=True)
    assert set(policy.realized) == {(KEPT, 2), (PLAIN, 2), (NETWORK, 2)}
    assert policy.realized[(NETWORK, 2)].rate == pytest.approx(5 / 0.024)
