"""Every tensor the per-round path makes is placed on the configured device (#28).

No GPU here, so the check is the one a CPU can make: every torch factory call of the
target, the drafter and the engine during prefill and verify rounds names its device
(``tests/device_check.py``). A call without one would land on the host when the device
is a GPU: a hidden copy each round, or a device mismatch.
"""

from __future__ import annotations

import pytest
import torch

from services.engine.core import Engine, EngineConfig
from services.engine.params import SamplingParams
from target_actor.batch import PrefillBatch, SeqSampling, VerifyBatch
from target_actor.config import TargetConfigError
from target_actor.messages import Proposal
from target_actor.runner import TargetRunner, TargetSpec
from target_actor.worker import LocalTarget
from tests.device_check import unplaced_factories
from tests.unit.test_engine import ByteTokenizer, prompts, random_drafter


def _rounds(target: LocalTarget, sampling: list[SeqSampling]) -> None:
    """A prefill, then verify rounds with drafts and without, for each sampling setting."""
    n = len(sampling)
    ids, ps = list(range(n)), prompts(n, 3)
    res, _ = target.prefill(PrefillBatch(ids, ps, sampling, want_views=False))
    anchors = [c[-1] for c in res.committed]
    positions = [len(p) for p in ps]
    k = 3
    for step in range(3):
        num_draft = [k if (i + step) % 2 else 0 for i in range(n)]
        tokens = torch.randint(0, 97, (n, k), device="cpu")
        q_ids = tokens.unsqueeze(-1)
        proposal = Proposal(tokens, q_ids, torch.ones(n, k, 1, device="cpu"))
        res, _ = target.verify(
            VerifyBatch(ids, anchors, positions, num_draft, want_updates=False), proposal
        )
        positions = [p + len(c) for p, c in zip(positions, res.committed, strict=True)]
        anchors = [c[-1] for c in res.committed]


@pytest.mark.parametrize("quant", ["none", "int4"])
def test_target_rounds_name_their_device(tiny_checkpoints, quant):
    target = LocalTarget(TargetSpec(str(tiny_checkpoints["qwen2"]), quant=quant))
    sampling = [
        SeqSampling(),
        SeqSampling(temperature=0.8, top_k=20, seed=7, logprobs=2),
        SeqSampling(temperature=1.0, top_p=0.9, repetition_penalty=1.2, frequency_penalty=0.3),
        SeqSampling(logit_bias={5: 2.0}, min_tokens=4, stop_ids=(1,), presence_penalty=0.5),
    ]
    with unplaced_factories() as sites:
        _rounds(target, sampling)
    assert not sites, "factories without a device on the per-round path:\n" + "\n".join(
        sorted(sites)
    )


def test_spec_engine_rounds_name_their_device(tiny_checkpoints):
    """Engine, target and drafter together: prefill, drafted rounds, carry, copies."""
    path = tiny_checkpoints["llama"]
    target = LocalTarget(TargetSpec(str(path), kv_cache_tokens=8192))
    engine = Engine(target, ByteTokenizer(), random_drafter(path, k=4), EngineConfig(k=4))
    params = [
        SamplingParams(max_tokens=16, ignore_eos=True),
        SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.9, seed=3),
    ]
    with unplaced_factories() as sites:
        for p in params:
            engine.generate(prompts(3, 5), p)
    assert not sites, "factories without a device on the per-round path:\n" + "\n".join(
        sorted(sites)
    )


def test_device_errors_are_one_line(tiny_checkpoints):
    path = str(tiny_checkpoints["llama"])
    if not torch.cuda.is_available():
        with pytest.raises(TargetConfigError, match="no CUDA device") as err:
            TargetRunner(TargetSpec(path, device="cuda"))
        assert "\n" not in str(err.value)
    with pytest.raises(TargetConfigError, match="CPU kernels only"):
        TargetSpec(path, device="cuda", quant="int4").resolved()
    with pytest.raises(TargetConfigError, match="unknown device"):
        TargetRunner(TargetSpec(path, device="tpu9"))


def test_cuda_auto_form_is_bf16_without_timing():
    from target_actor.weight_choice import choose

    choice = choose("auto", "auto", (128, 64), "cuda")
    assert (choice.dtype, choice.quant, choice.timings_ms) == (torch.bfloat16, "none", {})
