"""Our decoder against transformers on tiny random Llama / Qwen2 / Qwen3 checkpoints."""

from __future__ import annotations

import pytest
import torch

from target_actor.batch import ForwardBatch
from target_actor.runner import TargetRunner, TargetSpec

ARCHS = ["llama", "qwen2", "qwen3"]


def hf_logits(path, tokens: list[int]) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


def prompt(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (n,), generator=g).tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_transformers(tiny_checkpoints, arch):
    tokens = prompt(23)
    runner = TargetRunner(TargetSpec(str(tiny_checkpoints[arch])))
    ours = runner.forward(ForwardBatch.single(0, tokens, 0, num_logits=len(tokens))).logits
    ref = hf_logits(tiny_checkpoints[arch], tokens)
    assert (ours - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_incremental_decode_matches_full_forward(tiny_checkpoints, arch):
    tokens = prompt(20, seed=2)
    runner = TargetRunner(TargetSpec(str(tiny_checkpoints[arch])))
    runner.forward(ForwardBatch.single(0, tokens[:12], 0))
    steps = [
        runner.forward(ForwardBatch.single(0, [t], 12 + i)).logits[0]
        for i, t in enumerate(tokens[12:])
    ]
    ref = hf_logits(tiny_checkpoints[arch], tokens)[12:]
    assert (torch.stack(steps) - ref).abs().max().item() <= 1e-4


def test_ragged_batch_equals_each_sequence_alone(tiny_checkpoints):
    path = str(tiny_checkpoints["qwen3"])
    seqs = [prompt(n, seed=10 + n) for n in (5, 17, 1, 9)]
    alone = TargetRunner(TargetSpec(path))
    expected = []
    for i, s in enumerate(seqs):
        expected.append(alone.forward(ForwardBatch.single(i, s, 0, num_logits=len(s))).logits)
    batched = TargetRunner(TargetSpec(path))
    out = batched.forward(
        ForwardBatch(
            seq_ids=[0, 1, 2, 3],
            token_ids=torch.tensor([t for s in seqs for t in s]),
            num_new=[len(s) for s in seqs],
            start_pos=[0] * 4,
            num_logits=[len(s) for s in seqs],
        )
    ).logits
    assert (out - torch.cat(expected)).abs().max().item() <= 1e-5
    # a second ragged step mixing decode (1 token) and verify-sized blocks (4 tokens)
    more = [prompt(n, seed=40 + n) for n in (1, 4, 4, 1)]
    step = batched.forward(
        ForwardBatch(
            seq_ids=[0, 1, 2, 3],
            token_ids=torch.tensor([t for s in more for t in s]),
            num_new=[len(s) for s in more],
            start_pos=[len(s) for s in seqs],
            num_logits=[1, 4, 2, 1],
        )
    ).logits
    ref = [hf_logits(path, s + m)[-k:] for s, m, k in zip(seqs, more, [1, 4, 2, 1], strict=True)]
    assert (step - torch.cat(ref)).abs().max().item() <= 1e-4


def test_rollback_then_reforward_equals_fresh(tiny_checkpoints):
    path = str(tiny_checkpoints["llama"])
    base, wrong, right = prompt(10, 3), prompt(6, 4), prompt(6, 5)
    runner = TargetRunner(TargetSpec(path))
    runner.forward(ForwardBatch.single(7, base, 0))
    runner.forward(ForwardBatch.single(7, wrong, 10, num_logits=6))
    # start_pos=12 keeps two of the wrong rows, then writes four fresh ones
    got = runner.forward(ForwardBatch.single(7, right[:4], 12, num_logits=4)).logits
    ref = hf_logits(path, base + wrong[:2] + right[:4])[-4:]
    assert (got - ref).abs().max().item() <= 1e-4


def test_taps_shapes_and_values(tiny_checkpoints):
    import transformers

    path = tiny_checkpoints["qwen2"]
    runner = TargetRunner(TargetSpec(str(path), num_taps=2))
    taps = runner.cfg.tap_layer_ids
    tokens = prompt(8, 6)
    out = runner.forward(ForwardBatch.single(0, tokens, 0, taps=True))
    cfg = runner.cfg
    assert out.tap_hidden.shape == (8, len(taps), cfg.hidden_size)
    assert out.tap_k.shape == (len(taps), 8, cfg.num_kv_heads, cfg.head_dim)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hs = model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    for j, layer in enumerate(taps):  # hidden_states[l + 1] is the output of layer l
        assert (out.tap_hidden[:, j] - hs[layer + 1][0]).abs().max().item() <= 1e-4
    # the tapped K rows are exactly what the cache holds (post-RoPE)
    k_cached, v_cached = runner.cache.view(taps[0], 0, 8)
    assert torch.equal(out.tap_k[0].transpose(0, 1), k_cached)
    assert torch.equal(out.tap_v[0].transpose(0, 1), v_cached)


@pytest.mark.parametrize(
    "arch,rope",
    [
        (
            "llama",
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
        ("qwen3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
        ("qwen2", {"rope_type": "linear", "factor": 2.0}),
    ],
)
def test_rope_scaling_matches_transformers(tmp_path, arch, rope):
    from tests.conftest import make_tiny_checkpoint

    path = make_tiny_checkpoint(
        tmp_path / arch,
        arch,
        rope_parameters={**rope, "rope_theta": 10000.0},
        tie_word_embeddings=True,
    )
    tokens = prompt(60, 9)
    runner = TargetRunner(TargetSpec(str(path)))
    assert runner.cfg.rope_scaling and runner.cfg.tie_word_embeddings
    ours = runner.forward(ForwardBatch.single(0, tokens, 0, num_logits=60)).logits
    assert (ours - hf_logits(path, tokens)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("n", [8, 16])
def test_mkl_packed_rows_match_plain_linear(tiny_checkpoints, n):
    from target_actor.linear import mkl_packing_available

    if not mkl_packing_available():
        pytest.skip("no MKL packed GEMM in this torch build")
    path = str(tiny_checkpoints["qwen2"])
    tokens = prompt(30, 11)
    packed = TargetRunner(TargetSpec(path, packed_rows=(n,)))
    plain = TargetRunner(TargetSpec(path, packed_rows=()))
    assert packed.model.layers[0].lin_qkv.packs and not plain.model.layers[0].lin_qkv.packs
    for r in (packed, plain):
        r.forward(ForwardBatch.single(0, tokens[:-n], 0))
    got = packed.forward(ForwardBatch.single(0, tokens[-n:], 30 - n, num_logits=n)).logits
    ref = plain.forward(ForwardBatch.single(0, tokens[-n:], 30 - n, num_logits=n)).logits
    assert (got - ref).abs().max().item() <= 1e-4
    assert (ref - hf_logits(path, tokens)[-n:]).abs().max().item() <= 1e-4
