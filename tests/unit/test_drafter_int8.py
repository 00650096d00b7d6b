"""The drafter's int8 form: Q8_0 GEMM weights through the VNNI kernels (``csrc/q4.c``).

Its drafts may differ from the fp32 drafter's where two tokens nearly tie (exactness
never depends on it: ``q`` is what the drafts were sampled from, and the sampling tests
cover any proposal); these tests check that it computes what its weights say and that
it is chosen where it applies.
"""

from __future__ import annotations

import pytest
import torch

from drafter_actor.config import DrafterConfig
from drafter_actor.drafter import Drafter
from drafter_actor.worker import DrafterSpec, DrafterWorker
from target_actor.config import ModelConfig
from target_actor.linear import native_q4_lib
from tests.conftest import make_tiny_checkpoint

pytestmark = pytest.mark.skipif(
    native_q4_lib((16, 32)) is None, reason="needs the C kernels with AVX512-VNNI"
)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    # every GEMM shape a multiple of the kernel's tiles: 16 outputs, 32 inputs
    return make_tiny_checkpoint(tmp_path_factory.mktemp("t"), "llama", vocab_size=128)


def _drafter(target, **overrides) -> Drafter:
    cfg = DrafterConfig.for_target(
        ModelConfig.from_pretrained(target), block_size=4, mlp_width=64, markov_rank=32,
        **overrides,
    )  # fmt: skip
    return Drafter.random(target, cfg, seed=3, init_std=0.2)


def _q8(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the drafter's GEMMs take it: one int8 plane per 32 inputs (llama.cpp's Q8)."""
    blocks = x.view(x.shape[0], -1, 32)
    dx = blocks.abs().amax(-1, keepdim=True) / 127.0
    return (torch.round(blocks / dx) * dx).view_as(x)


def test_int8_logits_follow_the_quantized_weights(target):
    ref, q = _drafter(target), _drafter(target).quantize_int8()
    h = torch.randn(5, ref.cfg.target.hidden_size)
    with torch.no_grad():
        want, got = ref.net.logits(h), q.net.logits(h)
        x = torch.randn(3, ref.cfg.target.hidden_size)
        layer_ref, layer_q = ref.net.layers[0].gate_up, q.net.layers[0].gate_up
        assert layer_q.q8 is not None
        assert layer_q.q8.planes == 1
        exact = _q8(x) @ layer_q.q8.dequantized().t()  # what the int8 weights hold, in fp32
        torch.testing.assert_close(layer_q(x), exact, rtol=1e-3, atol=1e-4)
        assert (layer_q(x) - layer_ref(x)).abs().max() < 0.02 * layer_ref(x).abs().max()
    assert (got - want).abs().max() < 0.02 * want.abs().max()


def test_auto_form_is_int8_where_it_fits(target):
    worker = DrafterWorker(DrafterSpec(str(target), "random", k=4, overrides={
        "mlp_width": 64, "markov_rank": 32,
    }))  # fmt: skip
    assert worker.drafter.net.lm_head_q8 is not None
    bf16 = DrafterWorker(DrafterSpec(str(target), "random", k=4, dtype="bfloat16"))
    assert bf16.drafter.net.lm_head_q8 is None


def test_int8_needs_fitting_shapes(tmp_path):
    odd = make_tiny_checkpoint(tmp_path / "odd", "llama")  # vocab 97: no 16-row tiles
    from drafter_actor.config import DrafterConfigError

    with pytest.raises(DrafterConfigError, match="VNNI"):
        Drafter.random(odd, seed=0).quantize_int8()
