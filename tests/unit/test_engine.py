"""The engine on a tiny random target: lossless spec decoding, batching, stops, aborts."""

from __future__ import annotations

import random

import pytest
import torch

from services.engine.core import Engine, EngineConfig
from services.engine.params import InvalidRequest, SamplingParams
from target_actor.config import TargetConfigError
from target_actor.runner import TargetSpec
from target_actor.worker import LocalTarget


class ByteTokenizer:
    """Decodes ids as letters; enough for stop strings and streaming on a 97-token vocab."""

    eos_token_id = None

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


def make_engine(path, drafter=None, k=4, max_num_seqs=8, kv_tokens=8192) -> Engine:
    target = LocalTarget(TargetSpec(str(path), kv_cache_tokens=kv_tokens))
    return Engine(target, ByteTokenizer(), drafter, EngineConfig(k=k, max_num_seqs=max_num_seqs))


def random_drafter(path, k=4, carry=True, seed=0, **overrides):
    from drafter_actor.worker import LocalDrafter

    return LocalDrafter(
        target_path=str(path),
        drafter_path="random",
        k=k,
        carry=carry,
        seed=seed,
        overrides=overrides or None,
    )


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(97) for _ in range(rng.randint(1, 30))] for _ in range(n)]


def naive_greedy(path, prompt: list[int], n: int) -> list[int]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out[0, len(prompt) :].tolist()


def test_plain_mode_equals_transformers_greedy(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    engine = make_engine(path)
    ps = prompts(3, 1)
    outs = engine.generate(ps, SamplingParams(max_tokens=12, ignore_eos=True))
    for p, out in zip(ps, outs, strict=True):
        assert out.token_ids == naive_greedy(path, p, 12)
        assert out.finish_reason == "length"


@pytest.mark.parametrize("carry", [True, False])
def test_spec_greedy_equals_plain_with_random_drafter(tiny_checkpoints, carry):
    path = tiny_checkpoints["qwen3"]
    ps = prompts(6, 2)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    plain = make_engine(path).generate(ps, params)
    spec_engine = make_engine(path, random_drafter(path, k=4, carry=carry))
    spec = spec_engine.generate(ps, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert spec_engine.stats.spec.num_drafts > 0


@pytest.mark.parametrize("sure_ngram", [2, 5])
def test_spec_greedy_with_context_copy_equals_plain(tiny_checkpoints, sure_ngram):
    path = tiny_checkpoints["llama"]
    ps = [p * 3 for p in prompts(6, 4)]  # repeated prompts: copies to find
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = make_engine(path).generate(ps, params)
    drafter = random_drafter(
        path, k=4, context_copy=True, copy_input=True, copy_sure_ngram=sure_ngram
    )
    spec_engine = make_engine(path, drafter)
    spec = spec_engine.generate(ps, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert drafter.worker.drafter.num_copied > 0
    stats = spec_engine.stats.spec
    assert stats.num_accepted_tokens > 0


def test_sequences_join_and_leave_mid_run(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    ps = prompts(8, 3)
    lengths = [5, 17, 9, 23, 3, 11, 30, 7]
    ref = {
        i: make_engine(path)
        .generate([p], SamplingParams(max_tokens=n, ignore_eos=True))[0]
        .token_ids
        for i, (p, n) in enumerate(zip(ps, lengths, strict=True))
    }
    engine = make_engine(path, random_drafter(path, k=5), max_num_seqs=3)
    finals = {}
    pending = list(range(8))
    rng = random.Random(0)
    while pending or engine.has_unfinished():
        if pending and (
            rng.random() < 0.6 or not engine.has_unfinished()
        ):  # arrivals between rounds
            i = pending.pop(0)
            engine.add_request(
                ps[i],
                SamplingParams(max_tokens=lengths[i], ignore_eos=True),
                request_id=str(i),
                on_output=lambda o: o.finished and finals.__setitem__(o.request_id, o),
            )
        engine.step()
    assert {int(r): o.token_ids for r, o in finals.items()} == ref
    assert engine.target.kv_stats()["num_seqs"] == 0
    assert engine.drafter.num_states() == 0


def test_stop_strings_across_rounds_and_streaming(tiny_checkpoints):
    path = tiny_checkpoints["qwen2"]
    engine = make_engine(path, random_drafter(path, k=6))
    p = prompts(1, 4)[0]
    full = make_engine(path).generate([p], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    stop = full.text[17:20]  # a 3-letter string that occurs in the greedy output
    cut = full.text.find(stop)
    pieces = []
    engine.add_request(
        p, SamplingParams(max_tokens=40, stop=[stop], ignore_eos=True), "s", on_output=pieces.append
    )
    while engine.has_unfinished():
        engine.step()
    final = pieces[-1]
    assert final.finished and final.finish_reason == "stop"
    assert final.text == full.text[:cut]
    assert "".join(o.new_text for o in pieces) == final.text  # the stream never showed the stop


def test_sixteen_concurrent_mixed_settings_and_abort(tiny_checkpoints):
    path = tiny_checkpoints["qwen3"]
    engine = make_engine(path, random_drafter(path, k=4), max_num_seqs=16)
    ps = prompts(16, 5)
    finals = {}
    for i, p in enumerate(ps):
        params = SamplingParams(
            max_tokens=5 + i,
            temperature=0.0 if i % 2 else 0.8,
            top_p=0.9 if i % 3 else 1.0,
            top_k=0 if i % 4 else 20,
            seed=i,
            stop=["zz"] if i % 5 == 0 else [],
            ignore_eos=True,
        )
        engine.add_request(
            p,
            params,
            str(i),
            on_output=lambda o: o.finished and finals.__setitem__(o.request_id, o),
        )
    engine.step()
    engine.step()
    engine.abort("3")
    engine.abort("8")
    while engine.has_unfinished():
        engine.step()
    assert len(finals) == 16
    assert finals["3"].finish_reason == finals["8"].finish_reason == "abort"
    for i in set(range(16)) - {3, 8}:
        o = finals[str(i)]
        assert o.finish_reason in ("length", "stop")
        assert len(o.token_ids) <= 5 + i
        if o.finish_reason == "length":
            assert len(o.token_ids) == 5 + i
    assert (
        engine.target.kv_stats()["num_seqs"] == 0 and engine.target.kv_stats()["used_blocks"] == 0
    )
    assert engine.drafter.num_states() == 0
    assert engine.scheduler.reserved_tokens == 0


def test_seeded_sampling_is_reproducible_across_batches(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    p = prompts(1, 6)[0]
    params = SamplingParams(max_tokens=15, temperature=1.0, seed=123, ignore_eos=True)
    alone = make_engine(path, random_drafter(path)).generate([p], params)[0].token_ids
    others = prompts(3, 7)
    mixed = (
        make_engine(path, random_drafter(path))
        .generate(others + [p], [SamplingParams(max_tokens=9, temperature=0.7)] * 3 + [params])[-1]
        .token_ids
    )
    assert alone == mixed


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-2), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-3), "top_k"),
    ],
)
def test_bad_sampling_settings_are_typed_errors(kwargs, field):
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**kwargs)
    assert err.value.param == field


def test_bad_prompts_do_not_disturb_others(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    engine = make_engine(path, random_drafter(path))
    good = engine.add_request([1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True), "good")
    with pytest.raises(InvalidRequest):
        engine.add_request([], SamplingParams())
    with pytest.raises(TargetConfigError):
        engine.add_request([1] * 300, SamplingParams())  # context is 256
    with pytest.raises(InvalidRequest):
        engine.add_request([1000], SamplingParams())
    while engine.has_unfinished():
        engine.step()
    assert len(good.output_ids) == 6
