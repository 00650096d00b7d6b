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
from target_actor.messages import PrefillViews
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


def _prefill(drafter: Drafter, seq_ids: list[int], length: int = 40) -> None:
    """Random views for ``seq_ids`` (the block pass reads them as they are)."""
    cfg, gen = drafter.cfg, torch.Generator().manual_seed(sum(seq_ids))
    t, L, w = cfg.target, cfg.num_layers, min(cfg.window, length)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    drafter.prefill([
        PrefillViews(
            seq_id=s, length=length,
            window_k=rand(L, w, t.num_kv_heads, t.head_dim),
            window_v=rand(L, w, t.num_kv_heads, t.head_dim),
            summary_m=rand(L, t.num_heads, cfg.summary_slots, t.head_dim),
            summary_lam=rand(L, t.num_heads, cfg.summary_slots),
            boundary=rand(L, t.hidden_size),
        )
        for s in seq_ids
    ])  # fmt: skip


def _block_logits(drafter: Drafter, seq_ids: list[int], x: torch.Tensor) -> torch.Tensor:
    states = [drafter.state(s) for s in seq_ids]
    positions = torch.tensor([s.length for s in states])[:, None] + torch.arange(x.shape[1])
    with torch.no_grad():
        return drafter.net.block_logits(x, positions, drafter._contexts(states))


def test_the_block_pass_in_one_c_call_computes_the_python_paths_logits(target):
    drafter = _drafter(target).quantize_int8()
    net = drafter.net
    assert net.native_pass is not None and net.markov.native_greedy is not None
    _prefill(drafter, [1, 2])
    x = torch.randn(
        2, 5, drafter.cfg.target.hidden_size, generator=torch.Generator().manual_seed(0)
    )
    got = _block_logits(drafter, [1, 2], x)
    # one sequence alone: the same bits as in the batch (every kernel works row by row)
    assert torch.equal(_block_logits(drafter, [2], x[1:]), got[1:])
    native, net.native_pass = net.native_pass, None  # the Python path: layers, then logits
    want = _block_logits(drafter, [1, 2], x)
    net.native_pass = native
    assert got.shape == want.shape == (2, 4, drafter.cfg.draft_vocab_size)
    # the same int8 weights and kernels; SiLU and RoPE round their own way in C
    assert (got - want).abs().max() < 0.02 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def test_the_markov_heads_greedy_draft_in_c_is_the_loops():
    from drafter_actor.markov import MarkovHead
    from drafter_actor.native_pass import NativeMarkovGreedy
    from target_actor.linear import Int8Linear

    gen = torch.Generator().manual_seed(1)
    head = MarkovHead(64, 32).requires_grad_(False)
    head.w1.copy_(torch.randn(65, 32, generator=gen))
    head.w2.copy_(torch.randn(32, 64, generator=gen))
    head.w2[:, 9] = head.w2[:, 7]  # with base below, a tie at slot 1 of sequence 0
    head.w2t_q8 = Int8Linear(head.w2.data.t(), planes=1)
    base = torch.randn(3, 5, 64, generator=gen)
    base[0, 0, 7] = base[0, 0, 9] = 1e4  # the first of equal maxima wins, as in torch
    anchor = torch.tensor([64, 3, 17])  # 64: the out-of-vocabulary row
    with torch.no_grad():
        want = head.greedy(base, anchor)
        head.native_greedy = NativeMarkovGreedy.build(head)
        got = head.greedy(base, anchor)
    assert head.native_greedy is not None
    assert torch.equal(got, want) and got[0, 0] == 7


def test_the_context_rows_in_c_are_the_torch_projection(target):
    """The round's boundary row of each sequence, K/V by one GEMM, RoPE and the write into
    its buffer in C: what ``project_context`` gives in torch, after the window ring."""
    drafter = _drafter(target, carry=False).quantize_int8()
    _prefill(drafter, [1, 2], length=30)
    states = [drafter.state(1), drafter.state(2)]
    net, W = drafter.net, states[0].ring_rows
    with torch.no_grad():  # as propose runs (with gradients the GEMMs are the fp32 ones)
        contexts = drafter._contexts(states)
        feats = net.fuse(torch.stack([s.boundary for s in states])).unsqueeze(1)
        pos = torch.tensor([[s.length - 1] for s in states])
        want = net.project_context(feats, pos)  # L x ([n, H_kv, 1, hd], same)
    for i, s in enumerate(states):
        for layer, (k, v) in enumerate(want):
            torch.testing.assert_close(s.context_k[layer, :, W], k[i, :, 0], rtol=1e-6, atol=1e-6)
            assert torch.equal(s.context_v[layer, :, W], v[i, :, 0])
    assert contexts[0].refs is not None and contexts[0].mask.shape == (2, W + 1)
    assert contexts[0].mask[:, :30].all() and not contexts[0].mask[:, 30:W].any()
    assert contexts[0].mask[:, W].all()
