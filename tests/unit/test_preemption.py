"""KV pressure: the scheduler's block books, preemption of the newest, exact recompute.

A preempted sequence drops its KV cache and its drafter views, keeps its sampling state
on the ranks, and has its cache rebuilt (prompt on its prefill grid, output in short
row-exact blocks) before its next round: its tokens must be the ones it would have had
with room to spare.
"""

from __future__ import annotations

import pytest

from services.engine.params import SamplingParams
from services.engine.scheduler import Scheduler
from services.engine.sequence import SeqStatus, Sequence
from target_actor.verifier import _replay_segments
from tests.unit.test_engine import make_engine, prompts, random_drafter


def _seq(i: int, prompt_len: int, max_tokens: int = 100) -> Sequence:
    return Sequence(i, f"r{i}", [1] * prompt_len, SamplingParams(max_tokens=max_tokens), None)


def test_scheduler_admits_by_current_need_and_preempts_the_newest():
    sched = Scheduler(12, 16, max_num_seqs=8, max_prefill_seqs=8, lookahead=5, max_len=256)
    seqs = [_seq(i, 30) for i in range(4)]
    for s in seqs:
        sched.add(s)
    admitted = sched.admit()
    assert admitted == seqs  # 3 blocks each (30 + 5 rows): by need, not by max_tokens
    assert sched.used_blocks == 12 and sched.free_blocks == 0
    for s in seqs:
        s.output_ids = [7] * 40  # each now needs 30 + 39 + 5 = 74 rows: 5 blocks
    preempted = sched.grow()
    # the oldest grow, the newest give their blocks back, and head the queue in order
    assert preempted == [seqs[3], seqs[2]]
    assert list(sched.waiting) == [seqs[2], seqs[3]]
    assert all(s.status is SeqStatus.WAITING and s.preemptions == 1 for s in preempted)
    assert sched.running == seqs[:2]
    assert sched.used_blocks == sum(sched.blocks.values()) <= sched.total_blocks
    assert all(sched.granted(s) >= 74 for s in sched.running)
    sched.finish(seqs[0])
    assert sched.admit() == [seqs[2]]  # the preempted come back first, at their length now
    assert sched.granted(seqs[2]) >= 74


def test_full_means_a_request_waits_for_room_not_for_its_turn_to_prefill():
    sched = Scheduler(64, 16, max_num_seqs=3, max_prefill_seqs=1, lookahead=5, max_len=256)
    seqs = [_seq(i, 30) for i in range(5)]
    for s in seqs:
        sched.add(s)
    assert sched.admit() == seqs[:1] and not sched.full()  # the rest prefill in later steps
    sched.admit(), sched.admit()
    assert len(sched.running) == 3 and sched.full()  # every slot taken
    small = Scheduler(6, 16, max_num_seqs=8, max_prefill_seqs=8, lookahead=5, max_len=256)
    for s in [_seq(i, 30) for i in range(3)]:
        small.add(s)
    assert len(small.admit()) == 2 and small.full()  # no KV room for the third


def test_the_newest_short_of_room_preempts_itself_not_an_older_one():
    sched = Scheduler(4, 16, max_num_seqs=4, max_prefill_seqs=4, lookahead=1, max_len=256)
    a, b = _seq(0, 20), _seq(1, 20)
    sched.add(a)
    sched.add(b)
    assert sched.admit() == [a, b]  # 2 blocks each
    a.output_ids = [1]  # still 21 rows
    b.output_ids = [1] * 20  # 40 rows: 3 blocks, and none is free
    assert sched.grow() == [b]
    assert sched.running == [a] and sched.free_blocks == 2


def test_requests_that_cannot_finish_alone_are_refused_at_arrival():
    sched = Scheduler(8, 16, max_num_seqs=4, max_prefill_seqs=4, lookahead=5, max_len=1024)
    assert sched.can_ever_fit(_seq(0, 20, max_tokens=100))  # 125 rows: 8 blocks
    assert not sched.can_ever_fit(_seq(1, 20, max_tokens=104))  # 129 rows: 9 blocks


def test_replay_follows_the_prefill_grid_then_short_blocks():
    assert _replay_segments(100, 100) == [(0, 100)]
    assert _replay_segments(2500, 2540) == [(0, 1024), (1024, 2048), (2048, 2500), (2500, 2532), (2532, 2540)]  # fmt: skip


def _pressured(path, drafter_factory, kv_tokens, ps, params):
    engine = make_engine(path, drafter_factory(), k=4, max_num_seqs=8, kv_tokens=kv_tokens)
    outs = engine.generate(ps, params)
    return engine, outs


@pytest.mark.parametrize("mode", ["plain", "spec"])
def test_greedy_under_kv_pressure_equals_room_to_spare(tiny_checkpoints, mode):
    """8 sequences that need ~760 rows at their longest share 320: several are preempted
    and recomputed, some more than once; every output equals the roomy run's."""
    path = tiny_checkpoints["qwen3"]
    ps = prompts(8, 5)
    params = [
        SamplingParams(max_tokens=60, ignore_eos=True),
        SamplingParams(max_tokens=60, ignore_eos=True, presence_penalty=0.8),  # a history
    ] * 4

    def drafter():
        return None if mode == "plain" else random_drafter(path, k=4)

    roomy, want = _pressured(path, drafter, 8192, ps, params)
    tight, got = _pressured(path, drafter, 320, ps, params)
    assert roomy.stats.preemptions == 0
    assert tight.stats.preemptions >= 4
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    # nothing left behind: blocks, caches, sampling state, drafter views
    assert tight.scheduler.used_blocks == 0 and not tight.scheduler.blocks
    verifier = tight.target.verifier
    assert not verifier.runner.cache.seqs and verifier.runner.cache.used_blocks == 0
    assert not verifier.sampling and not verifier.history and not verifier.generators
    if mode == "spec":
        assert tight.drafter.num_states() == 0


def test_seeded_sampling_under_kv_pressure_repeats_in_plain_mode(tiny_checkpoints):
    """A preempted seeded request keeps its generator on the ranks: plain decoding draws
    the same numbers as with room to spare."""
    path = tiny_checkpoints["llama"]
    ps = prompts(8, 6)
    params = [SamplingParams(max_tokens=50, ignore_eos=True, temperature=1.0, seed=s) for s in range(8)]  # fmt: skip
    roomy, want = _pressured(path, lambda: None, 8192, ps, params)
    tight, got = _pressured(path, lambda: None, 320, ps, params)
    assert tight.stats.preemptions > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_aborting_a_preempted_request_frees_its_state(tiny_checkpoints):
    path = tiny_checkpoints["qwen2"]
    engine = make_engine(path, None, k=4, max_num_seqs=8, kv_tokens=320)
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts(8, 7)]
    while not any(s.preemptions and s.status is SeqStatus.WAITING for s in seqs):
        engine.step()
    victim = next(s for s in seqs if s.preemptions and s.status is SeqStatus.WAITING)
    engine.abort(victim.request_id)
    assert victim.seq_id not in engine.target.verifier.sampling
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.used_blocks == 0
    assert not engine.target.verifier.sampling
    assert all(s.finish_reason == "length" for s in seqs if s is not victim)
