"""One request never fails or changes another: rounds that raise are split apart.

A hostile or unlucky request shares its round with healthy ones. When the verify (or the
prefill) raises, the engine retries the parts apart until the failing sequence is alone;
it finishes with an error, and every other sequence's tokens equal its solo run (greedy
and seeded sampling alike). Sampling settings at their extremes never raise at all.
"""

from __future__ import annotations

import pytest
import torch

from services.engine.core import Engine, EngineConfig
from services.engine.params import SamplingParams
from target_actor.runner import TargetSpec
from target_actor.sampling import target_probs
from target_actor.worker import LocalTarget
from tests.unit.test_engine import ByteTokenizer, prompts

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
HEALTHY = [GREEDY, GREEDY, SEEDED]


def engine_for(path, spec: bool = True) -> Engine:
    target = LocalTarget(TargetSpec(str(path), kv_cache_tokens=8192))
    drafter = None
    if spec:
        from drafter_actor.worker import LocalDrafter

        drafter = LocalDrafter(str(path), "random", k=4, init_std=0.3)
    return Engine(target, ByteTokenizer(), drafter, EngineConfig(k=4, max_num_seqs=8))


def solo(path, prompt, params, spec: bool = True) -> list[int]:
    return engine_for(path, spec).generate([prompt], params)[0].token_ids


class Hostile(RuntimeError):
    pass


def fail_when_present(engine: Engine, seq_id: int, method: str, after_calls: int = 0) -> dict:
    """Make the verifier's ``method`` raise on every batch holding ``seq_id`` (after it
    ran, so generators have drawn), from its ``after_calls``-th such batch on."""
    verifier = engine.target.verifier
    real = getattr(verifier, method)
    seen = {"n": 0}

    def hostile(seq_ids, *args):
        out = real(seq_ids, *args)
        if seq_id in seq_ids:
            seen["n"] += 1
            if seen["n"] > after_calls:
                raise Hostile(f"injected failure of sequence {seq_id}")
        return out

    setattr(verifier, method, hostile)
    return seen


def run_with_outputs(engine: Engine, ps, params) -> dict:
    finals = {}
    for p, sp in zip(ps, params, strict=True):
        engine.add_request(
            p, sp, on_output=lambda o: o.finished and finals.__setitem__(o.request_id, o)
        )
    while engine.has_unfinished():
        engine.step()
    return finals


@pytest.mark.parametrize("spec", [True, False])
def test_a_failing_verify_fails_only_its_sequence(tiny_checkpoints, spec):
    path = tiny_checkpoints["llama"]
    ps = prompts(4, 11)
    alone = [solo(path, p, sp, spec) for p, sp in zip(ps, HEALTHY, strict=False)]
    engine = engine_for(path, spec)
    if not spec:  # like TargetGroup: an updates handle even when none were asked for
        real_verify = engine.target.verify
        engine.target.verify = lambda batch, proposal: (real_verify(batch, proposal)[0], "ref")
    seqs = [engine.add_request(p, sp) for p, sp in zip(ps, HEALTHY + [GREEDY], strict=True)]
    bad = seqs[-1]
    seen = fail_when_present(engine, bad.seq_id, "_sample", after_calls=3)
    finals = {}
    for s in seqs:
        s.on_output = lambda o: o.finished and finals.__setitem__(o.request_id, o)
    while engine.has_unfinished():
        engine.step()
    assert seen["n"] > 3  # it failed mid-stream, in rounds shared with the others
    out = finals[bad.request_id]
    assert out.finish_reason == "error" and "injected failure" in out.error
    for s, want in zip(seqs, alone, strict=False):
        assert finals[s.request_id].token_ids == want and finals[s.request_id].error is None
    stats = engine.stats.summary()
    assert stats["isolated_failures"] == 1 and stats["split_rounds"] >= 1
    assert engine.target.kv_stats()["used_blocks"] == 0
    if spec:
        assert engine.drafter.num_states() == 0


def test_a_failing_prefill_fails_only_its_prompt(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    ps = prompts(4, 12)
    alone = [solo(path, p, sp) for p, sp in zip(ps, HEALTHY, strict=False)]
    engine = engine_for(path)
    seqs = [engine.add_request(p, sp) for p, sp in zip(ps, HEALTHY + [GREEDY], strict=True)]
    fail_when_present(engine, seqs[-1].seq_id, "_sample")  # its first sample: prefill
    finals = {}
    for s in seqs:
        s.on_output = lambda o: o.finished and finals.__setitem__(o.request_id, o)
    while engine.has_unfinished():
        engine.step()
    assert finals[seqs[-1].request_id].finish_reason == "error"
    for s, want in zip(seqs, alone, strict=False):
        assert finals[s.request_id].token_ids == want
    assert engine.stats.isolated_failures == 1
    assert engine.target.kv_stats()["used_blocks"] == 0 and engine.drafter.num_states() == 0


def test_a_drafter_that_raises_sends_the_round_plain(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    ps = prompts(3, 13)
    alone = [solo(path, p, GREEDY) for p in ps]
    engine = engine_for(path)
    real, calls = engine.drafter.propose, {"n": 0}

    def flaky(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected drafter failure")
        return real(*args)

    engine.drafter.propose = flaky
    outs = engine.generate(ps, GREEDY)
    assert [o.token_ids for o in outs] == alone  # greedy: plain decoding is the same text
    assert engine.stats.drafter_errors == 1 and engine.drafter.num_states() == 0


@pytest.mark.parametrize("top_p", [5e-324, 1e-320, 1e-46, 7e-46, 1e-8, 0.3, 1.0])
def test_any_top_p_in_range_gives_a_distribution(top_p):
    logits = torch.randn(4, 50) * 5
    p = target_probs(logits, 1.0, 0, top_p)
    assert torch.isfinite(p).all() and torch.allclose(p.sum(-1), torch.ones(4))
    if top_p < 1e-8:  # only the most likely token is left
        assert torch.equal(p.argmax(-1), logits.argmax(-1)) and bool((p.max(-1).values == 1).all())


@pytest.mark.parametrize("temperature", [1e-300, 1e-6, 1e-5, 0.01, 100.0])
@pytest.mark.parametrize("top_k", [0, 1, 10**9])
def test_extreme_settings_are_valid_and_finite(temperature, top_k):
    sp = SamplingParams(temperature=temperature, top_k=top_k, top_p=1e-300)
    if temperature < 1e-5:
        assert sp.greedy  # vLLM's rule: a temperature this small decodes greedily
        return
    p = target_probs(torch.randn(3, 40) * 30, sp.temperature, sp.top_k, sp.top_p)
    assert torch.isfinite(p).all() and torch.allclose(p.sum(-1), torch.ones(3))


def test_tiny_top_p_co_batched_with_greedy_streams(tiny_checkpoints):
    """The hostile request of the bug report: it is served, and the others are untouched."""
    path = tiny_checkpoints["llama"]
    ps = prompts(3, 14)
    alone = [solo(path, p, GREEDY) for p in ps[:2]]
    hostile = SamplingParams(max_tokens=24, temperature=1.0, top_p=1e-320, ignore_eos=True)
    engine = engine_for(path)
    finals = run_with_outputs(engine, ps, [GREEDY, GREEDY, hostile])
    outs = list(finals.values())
    assert [o.token_ids for o in outs[:2]] == alone
    assert outs[2].error is None and len(outs[2].token_ids) == 24
    # top-p keeps only the most likely token: the hostile request decodes greedily
    assert outs[2].token_ids == solo(path, ps[2], GREEDY)
    assert engine.stats.isolated_failures == 0


def test_a_sequence_whose_commit_raises_finishes_alone(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    ps = prompts(3, 15)
    alone = [solo(path, p, GREEDY) for p in ps[:2]]
    engine = engine_for(path)
    seqs = [engine.add_request(p, GREEDY) for p in ps]
    calls = {"n": 0}
    real = seqs[2].detokenizer.text

    def broken(ids):
        calls["n"] += 1
        if calls["n"] == 3:
            raise UnicodeError("injected detokenizer failure")
        return real(ids)

    seqs[2].detokenizer.text = broken
    finals = {}
    for s in seqs:
        s.on_output = lambda o: o.finished and finals.__setitem__(o.request_id, o)
    while engine.has_unfinished():
        engine.step()
    assert "injected detokenizer failure" in finals[seqs[2].request_id].error
    assert [finals[s.request_id].token_ids for s in seqs[:2]] == alone
    assert engine.stats.isolated_failures == 1 and engine.target.kv_stats()["used_blocks"] == 0


def test_a_failure_after_sampling_still_rewinds_the_seeded_generators(tiny_checkpoints):
    """The round fails while building the drafter's updates, after every sequence sampled:
    the seeded stream's retry draws the same numbers, so its text equals its solo run."""
    path = tiny_checkpoints["llama"]
    ps = prompts(3, 16)
    alone = [solo(path, p, sp) for p, sp in zip(ps, [GREEDY, SEEDED], strict=False)]
    engine = engine_for(path)
    seqs = [engine.add_request(p, sp) for p, sp in zip(ps, [GREEDY, SEEDED, GREEDY], strict=True)]
    verifier, bad = engine.target.verifier, seqs[-1].seq_id
    real, calls = verifier._round_updates, {"n": 0}

    def hostile(batch, *args):
        if bad in batch.seq_ids:
            calls["n"] += 1
            if calls["n"] > 2:
                raise Hostile("injected failure after sampling")
        return real(batch, *args)

    verifier._round_updates = hostile
    finals = {}
    for s in seqs:
        s.on_output = lambda o: o.finished and finals.__setitem__(o.request_id, o)
    while engine.has_unfinished():
        engine.step()
    assert "after sampling" in finals[seqs[-1].request_id].error
    assert [finals[s.request_id].token_ids for s in seqs[:2]] == alone


def test_a_drafter_update_that_raises_sends_its_sequences_plain(tiny_checkpoints):
    """Rounds without drafts hand their updates over with ``update``; if it raises, the
    sequences lose their drafter state and go on plainly, none fails."""
    path = tiny_checkpoints["llama"]
    ps = prompts(2, 17)
    alone = [solo(path, p, GREEDY) for p in ps]
    engine = engine_for(path)
    calls = {"n": 0}

    def broken(updates):
        calls["n"] += 1
        raise RuntimeError("injected update failure")

    engine.drafter.update = broken
    engine.planner.k = 1  # every round drafts 1 token, so the last round drafts none
    outs = engine.generate(ps, SamplingParams(max_tokens=3, ignore_eos=True))
    assert calls["n"] >= 1 and engine.stats.drafter_errors >= 1
    assert [o.token_ids for o in outs] == [a[:3] for a in alone] and all(
        o.error is None for o in outs
    )
    assert engine.drafter.num_states() == 0 and engine.target.kv_stats()["used_blocks"] == 0
