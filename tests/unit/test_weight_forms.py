"""Weight forms: int4 recovers a Q4_1 grid exactly, rows never depend on their batch, and
``auto`` is decided once per machine."""

from __future__ import annotations

import pytest
import torch

from target_actor.batch import ForwardBatch
from target_actor.config import TargetConfigError
from target_actor.linear import (
    Int4Linear,
    Int8Linear,
    WeightForm,
    quant_kernels_available,
    quantize_int4,
)
from target_actor.runner import TargetRunner, TargetSpec

pytestmark = pytest.mark.skipif(not quant_kernels_available(), reason="no CPU int kernels")


def q4_1_grid(out_f: int, in_f: int, seed: int = 0) -> torch.Tensor:
    """A weight as a dequantised GGUF Q4_1 tensor holds it: ``d * q + m`` per 32 inputs,
    ``d`` and ``m`` fp16, every block using its lowest and highest level."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out_f, in_f // 32, 32), generator=gen)
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(out_f, in_f // 32, 1, generator=gen) * 0.02 + 1e-3).half().float()
    m = (-torch.rand(out_f, in_f // 32, 1, generator=gen) * 0.1).half().float()
    return (d * q + m).reshape(out_f, in_f)


def test_int4_recovers_a_q4_1_grid_exactly():
    w = q4_1_grid(64, 128)
    q, scale, zero = quantize_int4(w)
    back = (q.float().view(64, -1, 32) - 8) * scale[..., None] + zero[..., None]
    assert torch.equal(back.view(64, 128), w)


def test_int4_linear_multiplies_by_its_grid_to_bf16_rounding():
    w = q4_1_grid(96, 64, seed=1)
    lin = Int4Linear(w)
    x = torch.randn(5, 64)
    got = lin(x)
    assert got.dtype == torch.float32 and got.shape == (5, 96)
    ref = x @ w.t()
    assert (got - ref).abs().max().item() <= 0.02 * ref.abs().max().item()
    assert (lin.dequantized() - w).abs().max().item() <= 0.01 * w.abs().max().item()


@pytest.mark.parametrize("cls", [Int4Linear, Int8Linear])
def test_each_row_is_independent_of_its_batch(cls):
    """A sequence's logits must not depend on what it is batched with."""
    lin = cls(torch.randn(256, 128) * 0.05)
    x = torch.randn(33, 128)
    whole = lin(x)
    for m in (1, 2, 8, 17):
        assert torch.equal(lin(x[:m]), whole[:m])
    assert torch.equal(lin(x[5:6]), whole[5:6])


def test_int4_falls_back_to_int8_where_inputs_do_not_group():
    assert isinstance(WeightForm("int4").make(torch.randn(8, 48)), Int8Linear)
    assert isinstance(WeightForm("int4").head().make(torch.randn(8, 64)), Int8Linear)


def test_q8_forms_keep_their_weights_and_take_one_activation_plane():
    """``-q8``: the same weight blocks, llama.cpp's one int8 activation plane, the head
    included; ``auto`` never picks them (they round the activations ~200x coarser)."""
    from target_actor.linear import EXACT_QUANTS, Int4Linear

    form = WeightForm("int4-q8")
    assert (form.bits, form.planes) == ("int4", 1) and WeightForm("int4").planes == 2
    assert form.head().quant == "int8-q8" and "int4-q8" not in EXACT_QUANTS
    w = torch.randn(32, 64)
    fast, exact = form.make(w), WeightForm("int4").make(w)
    assert isinstance(fast, Int4Linear) and fast.planes == 1 and exact.planes == 2
    assert torch.equal(fast.dequantized(), exact.dequantized())  # the same weights


@pytest.mark.parametrize("quant", ["int8", "int4", "int4-q8"])
def test_quantized_runner_decodes_like_its_own_prefill(tiny_checkpoints, quant):
    path = str(tiny_checkpoints["llama"])
    runner = TargetRunner(TargetSpec(path, quant=quant))
    layer = runner.model.layers[0]
    assert layer.qkv.numel() == 0 and layer.gate_up.numel() == 0  # dense copies freed
    tokens = torch.randint(0, 97, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    full = runner.forward(ForwardBatch.single(0, tokens, 0, num_logits=24)).logits
    runner.forward(ForwardBatch.single(1, tokens[:16], 0))
    step = runner.forward(ForwardBatch.single(1, tokens[16:], 16, num_logits=8)).logits
    assert (step - full[16:]).abs().max().item() <= 1e-4
    ref = TargetRunner(TargetSpec(path)).forward(ForwardBatch.single(0, tokens, 0, num_logits=24))
    # random weights quantize coarsely; the real model's agreement is `longspark bench forms`
    cos = torch.nn.functional.cosine_similarity(full.flatten(), ref.logits.flatten(), dim=0)
    assert cos.item() >= 0.9


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"dtype": "float8"}, "unknown dtype 'float8'"),
        ({"quant": "int3"}, "unknown quantization 'int3'"),
        ({"kv_dtype": "int8"}, "unknown KV cache dtype 'int8'"),
    ],
)
def test_unknown_forms_are_one_line_errors(tiny_checkpoints, kwargs, words):
    with pytest.raises(TargetConfigError) as err:
        TargetSpec(str(tiny_checkpoints["llama"]), **kwargs)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_auto_is_timed_once_per_machine(tiny_checkpoints, tmp_path, monkeypatch):
    from target_actor import weight_choice

    monkeypatch.setenv("LONGSPARK_HOME", str(tmp_path))
    spec = TargetSpec(str(tiny_checkpoints["llama"]), dtype="auto", quant="auto")
    first = spec.resolved()
    assert first.dtype in ("float32", "bfloat16") and first.quant in ("none", "int8", "int4")
    assert (tmp_path / "weight_forms.json").is_file()

    def no_probe(*_):
        raise AssertionError("probed again")

    monkeypatch.setattr(weight_choice, "probe", no_probe)
    assert spec.resolved() == first
    runner = TargetRunner(spec)
    assert (str(runner.dtype).removeprefix("torch."), runner.quant) == (first.dtype, first.quant)


@pytest.mark.parametrize(
    "quant, kv_dtype",
    [("int4", "auto"), ("int4", "bfloat16"), ("int4-q8", "auto"), ("none", "auto")],
)
def test_a_verify_block_equals_its_decode_steps_bit_for_bit(tiny_checkpoints, quant, kv_dtype):
    """Through bf16 GEMM inputs, spec == plain needs each verify row to be computed exactly
    as its 1-row decode step: int4 (fp32 stream) takes the C attention, which does each
    row alone (with an fp32 or a bf16 cache); bf16 takes torch's SDPA row by row
    (``row_exact``; with it off, the bf16 case fails here, checked when this was written)."""
    path = str(tiny_checkpoints["qwen2"])
    dtype = "float32" if quant.startswith("int4") else "bfloat16"
    runner = TargetRunner(TargetSpec(path, dtype=dtype, quant=quant, kv_dtype=kv_dtype))
    assert runner.cache.dtype == (torch.bfloat16 if kv_dtype == "bfloat16" else runner.dtype)
    assert runner.model.row_exact
    tokens = torch.randint(0, 97, (208,), generator=torch.Generator().manual_seed(5)).tolist()
    runner.forward(ForwardBatch.single(0, tokens[:200], 0))
    block = runner.forward(ForwardBatch.single(0, tokens[200:], 200, num_logits=8)).logits
    runner.forward(ForwardBatch.single(1, tokens[:200], 0))
    steps = [
        runner.forward(ForwardBatch.single(1, [t], 200 + i)).logits
        for i, t in enumerate(tokens[200:])
    ]
    assert torch.equal(block, torch.cat(steps))


def test_auto_takes_int4_for_a_q4_1_checkpoint_without_timing(tmp_path, monkeypatch):
    """A model dequantised from a Q4_1 GGUF (the default one is): ``auto`` multiplies by
    its own weights (int4, fp32 activations) instead of timing forms that re-round them."""
    from safetensors.torch import load_file, save_file

    from target_actor import weight_choice
    from target_actor.linear import native_q4_lib, quantize_q4_1
    from target_actor.weight_choice import holds_q4_1_weights
    from tests.conftest import make_tiny_checkpoint

    if native_q4_lib((16, 32)) is None:
        pytest.skip("needs the C kernels with AVX512-VNNI")
    path = make_tiny_checkpoint(tmp_path / "q4", "llama", vocab_size=128)
    assert not holds_q4_1_weights(str(path))  # random fp32 weights: timed as before
    weights = load_file(path / "model.safetensors")
    for name, w in weights.items():
        if name.startswith("model.layers.") and w.dim() == 2:
            q, d, m = quantize_q4_1(w)
            weights[name] = (d.repeat_interleave(32, 1) * q + m.repeat_interleave(32, 1)).to(
                w.dtype
            )
    save_file(weights, path / "model.safetensors")
    assert holds_q4_1_weights(str(path))

    def no_probe(*args):
        raise AssertionError("a Q4_1 checkpoint's auto form is not timed")

    monkeypatch.setattr(weight_choice, "probe", no_probe)
    spec = TargetSpec(str(path), dtype="auto", quant="auto").resolved()
    assert (spec.dtype, spec.quant) == ("float32", "int4")
    assert TargetSpec(str(path), dtype="bfloat16", quant="auto").resolved().quant == "int4"


def test_quantized_weights_move_into_one_huge_page_arena_unchanged():
    """``into_arena`` puts the linears' packed weights and scales in one 2 MB-aligned
    buffer (advised for huge pages) and the linears compute the same bits from it."""
    from target_actor.arena import HUGE_PAGE, into_arena

    gen = torch.Generator().manual_seed(5)
    lins = [Int4Linear(torch.randn(1024, 576, generator=gen)) for _ in range(8)]
    lins.append(Int8Linear(torch.randn(512, 576, generator=gen)))
    x = torch.randn(3, 576, generator=gen)
    before = [lin(x) for lin in lins]
    arena = into_arena(lins)
    assert arena is not None and arena.buf.data_ptr() % HUGE_PAGE == 0
    for lin, y in zip(lins, before, strict=True):
        held = [v for v in vars(lin).values() if isinstance(v, torch.Tensor)]
        assert held and all(
            arena.buf.data_ptr() <= t.data_ptr() < arena.buf.data_ptr() + arena.used for t in held
        )
        assert torch.equal(lin(x), y)
    assert into_arena(lins[:1]) is None  # under a huge page: left where it is


def test_forms_divergence_is_zero_for_the_reference_and_sees_a_shifted_form():
    """bench forms' teacher-forced reading: a form equal to the reference scores KL 0 and
    the same first token everywhere; one that moves a position's mass to another token is
    caught at that position only."""
    from services.bench.weight_forms import _divergence

    gen = torch.Generator().manual_seed(0)
    ref = [torch.log_softmax(torch.randn(n, 50, generator=gen) * 3, -1) for n in (4, 6)]
    same = _divergence(ref, [r.clone() for r in ref])
    assert same["kl_mean"] == 0 and same["same_top1"] == 1
    logits = [r.clone() for r in ref]
    logits[1][2, ref[1][2].argmin()] += 50.0  # the least likely token becomes the first
    shifted = _divergence(ref, [torch.log_softmax(g, -1) for g in logits])
    assert shifted["same_top1"] == 0.9  # 9 of 10 positions
    assert shifted["kl_p99"] > 1.0 and shifted["kl_mean"] > 0.1
