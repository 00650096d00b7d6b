"""Logits processors (penalties, logit bias, min_tokens) and logprobs under speculation.

Row ``j`` of a verify block must see the processors as plain decoding would after
generating the drafts before it; greedy spec output with penalties is then token-identical
to plain decoding, and the log-probabilities of every emitted token are equal too.
"""

from __future__ import annotations

import pytest
import torch

from services.engine.params import InvalidRequest, SamplingParams
from target_actor.batch import SeqSampling
from target_actor.logits_processors import TokenHistory
from tests.conftest import make_tiny_checkpoint

VOCAB = 50
PENALISED = SeqSampling(
    presence_penalty=0.7,
    frequency_penalty=0.4,
    repetition_penalty=1.3,
    logit_bias={3: 2.0, 7: -100.0},
    min_tokens=4,
    stop_ids=(0, 1),
)


def sequential(sampling, prompt, output, logits_rows, drafts):
    """Each row processed by a history that generated the drafts one at a time."""
    rows = []
    for j in range(len(drafts) + 1):
        hist = TokenHistory(sampling, prompt, VOCAB)
        hist.extend(output + drafts[:j])
        rows.append(hist.process(logits_rows[j : j + 1], [])[0])
    return torch.stack(rows)


def test_verify_rows_see_the_drafts_before_them():
    torch.manual_seed(0)
    prompt, output, drafts = [5, 6, 3], [3, 9], [9, 9, 2, 3]
    logits = torch.randn(len(drafts) + 1, VOCAB) * 3
    hist = TokenHistory(PENALISED, prompt, VOCAB)
    hist.extend(output)
    got = hist.process(logits.clone(), drafts)
    want = sequential(PENALISED, prompt, output, logits, drafts)
    assert torch.equal(got, want)
    # min_tokens: rows 0 and 1 (outputs 2 and 3) mask the stop ids, row 2 (output 4) not
    assert bool((got[:2, [0, 1]] == float("-inf")).all())
    assert bool(torch.isfinite(got[2:, [0, 1]]).all())


def test_history_rewinds_to_the_rounds_start():
    hist = TokenHistory(PENALISED, [1, 2], VOCAB)
    hist.extend([4, 4, 5])
    before = hist.counts.clone()
    hist.extend([6, 4])  # a round that is verified again after a failure
    hist.rewind(3)
    assert hist.output == [4, 4, 5] and torch.equal(hist.counts, before)


def test_sampling_params_check_their_ranges():
    for bad in (
        {"presence_penalty": 2.5},
        {"frequency_penalty": -3.0},
        {"repetition_penalty": 0.0},
        {"min_p": -0.1},
        {"min_tokens": 20, "max_tokens": 10},
        {"logprobs": 21},
        {"stop_token_ids": [-2]},
    ):
        with pytest.raises(InvalidRequest) as err:
            SamplingParams(**bad)
        assert err.value.param in bad
    assert SamplingParams(logit_bias={3: 500.0}).logit_bias == {3: 100.0}  # OpenAI's range


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama", vocab_size=64)


class Letters:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(48 + i) for i in ids)


@pytest.fixture(scope="module")
def engines(tiny):
    from drafter_actor.worker import LocalDrafter
    from services.engine.core import Engine, EngineConfig
    from target_actor.runner import TargetSpec
    from target_actor.worker import LocalTarget

    def make(spec: bool) -> Engine:
        target = LocalTarget(TargetSpec(str(tiny), kv_cache_tokens=8192))
        drafter = LocalDrafter(  # context copies: drafts that repeat the text get accepted
            target_path=str(tiny),
            drafter_path="random",
            k=4,
            seed=1,
            overrides={"context_copy": True, "copy_sure_ngram": 1},
        )
        return Engine(target, Letters(), drafter if spec else None, EngineConfig(k=4))

    return {"ar": make(False), "spec": make(True)}


PROMPTS = [[1, 2, 3, 4, 5], [7, 7, 7], [10, 20, 30, 40]]
SETTINGS = [
    {"logprobs": 3},
    {"presence_penalty": 1.5, "frequency_penalty": 0.8, "logprobs": 2},
    {"repetition_penalty": 1.6, "logprobs": 0},
    {"logit_bias": {5: 3.0, 9: -100.0}, "min_p": 0.2},
    {"frequency_penalty": -1.0, "repetition_penalty": 0.7},  # rewards repeats: drafts accepted
]


@pytest.mark.parametrize("setting", SETTINGS)
def test_greedy_spec_equals_plain_with_processors_and_logprobs(engines, setting):
    params = SamplingParams(max_tokens=24, ignore_eos=True, **setting)
    ar = engines["ar"].generate(PROMPTS, params)
    accepted = engines["spec"].stats.spec.num_accepted_tokens
    spec = engines["spec"].generate(PROMPTS, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in ar]
    accepted = engines["spec"].stats.spec.num_accepted_tokens - accepted
    if setting is SETTINGS[-1]:  # repeats rewarded: copies are accepted, mid-block rows count
        assert accepted >= 10
    if "logit_bias" in setting:
        assert all(9 not in o.token_ids for o in spec)
    if setting.get("logprobs") is None:
        assert all(o.logprobs is None for o in spec)
        return
    for a, s in zip(ar, spec, strict=True):
        assert len(s.logprobs) == len(s.token_ids)
        for x, y in zip(a.logprobs, s.logprobs, strict=True):
            assert x.token_id == y.token_id
            assert abs(x.logprob - y.logprob) <= 1e-5
            assert [t[1] for t in x.top] == [t[1] for t in y.top]
            assert len(y.top) == setting["logprobs"] and y.logprob <= 0.0


def test_logprobs_are_the_raw_model_distribution(engines):
    """vLLM's default: the raw logits' log-softmax, before penalties and temperature."""
    engine = engines["ar"]
    (out,) = engine.generate(
        [PROMPTS[0]], SamplingParams(max_tokens=1, frequency_penalty=2.0, logprobs=5)
    )
    from target_actor.batch import ForwardBatch

    target = engine.target
    logits = target.forward(ForwardBatch.single(99_999, PROMPTS[0], 0)).logits[0]
    target.free([99_999])
    want = torch.log_softmax(logits.float(), -1)
    entry = out.logprobs[0]
    assert abs(entry.logprob - float(want[entry.token_id])) < 1e-5
    assert [t[1] for t in entry.top] == want.topk(5).indices.tolist()


def test_min_tokens_holds_back_eos_and_stop_token_ids(engines):
    engine = engines["spec"]
    eos = 11
    engine.eos = (eos,)
    try:
        pushed = {eos: 100.0}  # EOS is all the model would say
        (out,) = engine.generate(
            [PROMPTS[0]], SamplingParams(max_tokens=20, min_tokens=6, logit_bias=pushed)
        )
        assert len(out.token_ids) == 6 and eos not in out.token_ids
        assert out.finish_reason == "stop"
        (out,) = engine.generate(
            [PROMPTS[1]],
            SamplingParams(max_tokens=20, logit_bias={13: 100.0}, stop_token_ids=[13]),
        )
        assert out.token_ids == [] and out.finish_reason == "stop"
        (out,) = engine.generate(
            [PROMPTS[1]],
            SamplingParams(
                max_tokens=20,
                logit_bias={13: 100.0},
                stop_token_ids=[13],
                include_stop_str_in_output=True,
            ),
        )
        assert out.token_ids == [13]
    finally:
        engine.eos = ()
