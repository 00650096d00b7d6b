"""Tensor parallel over Ray actors (gloo) equals TP=1."""

from __future__ import annotations

import pytest
import torch

from target_actor.batch import ForwardBatch
from target_actor.config import TargetConfigError
from target_actor.runner import TargetSpec
from target_actor.worker import LocalTarget, TargetGroup

pytestmark = pytest.mark.ray


def greedy(target, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Plain greedy decoding through the raw target interface; returns tokens and all logits."""
    out = target.forward(ForwardBatch.single(0, prompt, 0, num_logits=len(prompt)))
    logits = [out.logits]
    tokens, pos = [], len(prompt)
    nxt = int(out.logits[-1].argmax())
    for _ in range(steps):
        tokens.append(nxt)
        step = target.forward(ForwardBatch.single(0, [nxt], pos)).logits
        logits.append(step)
        pos += 1
        nxt = int(step[-1].argmax())
    target.free([0])
    return tokens, torch.cat(logits)


def test_tp2_tiny_equals_tp1(ray_local, tiny_checkpoints):
    spec = TargetSpec(str(tiny_checkpoints["qwen3"]))
    prompt = [5, 17, 3, 88, 42, 9, 1]
    ref_tokens, ref_logits = greedy(LocalTarget(spec), prompt, 12)
    group = TargetGroup(spec, tp=2)
    try:
        tokens, logits = greedy(group, prompt, 12)
        taps = group.forward(ForwardBatch.single(1, prompt, 0, taps=True))
        local_taps = LocalTarget(spec).forward(ForwardBatch.single(1, prompt, 0, taps=True))
    finally:
        group.shutdown()
    assert tokens == ref_tokens
    assert (logits - ref_logits).abs().max().item() <= 1e-4
    assert (taps.tap_k - local_taps.tap_k).abs().max().item() <= 1e-5
    assert (taps.tap_hidden - local_taps.tap_hidden).abs().max().item() <= 1e-4


def test_tp_not_dividing_heads_is_clear_error(ray_local, tiny_checkpoints):
    with pytest.raises(TargetConfigError, match="does not divide"):
        TargetGroup(TargetSpec(str(tiny_checkpoints["llama"])), tp=3)


@pytest.mark.slow
def test_tp3_smollm2_equals_tp1(ray_local, smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    prompt = tok("The capital of France is").input_ids
    spec = TargetSpec(str(smollm2_path))
    ref_tokens, ref_logits = greedy(LocalTarget(spec), prompt, 8)
    group = TargetGroup(spec, tp=3)
    try:
        tokens, logits = greedy(group, prompt, 8)
    finally:
        group.shutdown()
    assert tokens == ref_tokens
    assert (logits - ref_logits).abs().max().item() <= 1e-4
