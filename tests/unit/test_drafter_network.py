"""The drafter network's pure block pass and the Markov head's sampling, without a target."""

from __future__ import annotations

import pytest
import torch

from drafter_actor.config import DrafterConfig
from drafter_actor.markov import MarkovHead, sample_block
from drafter_actor.network import ContextRefs, DrafterNetwork, LayerContext
from target_actor import native
from target_actor.config import ModelConfig
from target_actor.summary import attend_rows

TARGET = ModelConfig.from_dict(
    {
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 50,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
    }
)
N, K, C, R = 3, 4, 7, 5


def make_net(seed: int = 0) -> DrafterNetwork:
    cfg = DrafterConfig.for_target(TARGET, summary_slots=R, block_size=K, markov_rank=8)
    net = DrafterNetwork(cfg, TARGET)
    net.init_random(seed, std=0.2)
    gen = torch.Generator().manual_seed(seed)
    embed = torch.randn(TARGET.vocab_size, TARGET.hidden_size, generator=gen)
    net.set_target_weights(embed, embed)
    return net


def make_contexts(
    net: DrafterNetwork, gen: torch.Generator, grad: bool = False
) -> list[LayerContext]:
    """Window rows from a 'target', summaries computed from G, carry rows via F + E_carry."""
    t, L = net.cfg.target, net.cfg.num_layers
    rows = torch.randn(L, 20, t.num_kv_heads, t.head_dim, generator=gen)
    summary_m, _ = attend_rows(net.summary_queries, rows, rows.flip(1), t.head_dim**-0.5)
    carry = torch.randn(N, 2, L, t.hidden_size, generator=gen, requires_grad=grad)
    feats = net.carry_features(carry)  # [N, 2, d]
    kv = net.project_context(feats, torch.tensor([[30, 31]]).expand(N, 2))
    window_k = torch.randn(N, L, t.num_kv_heads, C, t.head_dim, generator=gen)
    window_v = torch.randn(N, L, t.num_kv_heads, C, t.head_dim, generator=gen)
    mask = torch.rand(N, C + 2, generator=gen) < 0.8
    return [
        LayerContext(
            k=torch.cat([window_k[:, i], kv[i][0]], 2),
            v=torch.cat([window_v[:, i], kv[i][1]], 2),
            mask=mask,
            summary_m=summary_m[i].expand(N, -1, -1, -1),
            summary_mask=torch.ones(N, t.num_heads, R, dtype=torch.bool),
        )
        for i in range(L)
    ]


def block(net: DrafterNetwork) -> tuple[torch.Tensor, torch.Tensor]:
    anchors = torch.tensor([1, 7, 49])
    positions = torch.tensor([[30], [31], [32]]) + torch.arange(K + 1)
    return net.embed_block(anchors, K), positions


def test_block_pass_is_differentiable_in_every_drafter_weight():
    net = make_net()
    gen = torch.Generator().manual_seed(1)
    x, positions = block(net)
    h = net(x, positions, make_contexts(net, gen))  # [N, K+1, d]
    base = net.logits(h[:, 1:])  # [N, K, V]
    labels = torch.randint(0, 50, (N, K), generator=gen)
    prev = torch.cat([torch.tensor([[1], [7], [49]]), labels[:, :-1]], 1)
    logits = net.markov.teacher_forced(base, net.to_draft_ids(prev))
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    for name, p in net.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def naive_layer(layer, rope, h, positions, ctx: LayerContext, g) -> torch.Tensor:
    """The same layer, attention written head by head (query head j reads KV head j // group)."""
    from drafter_actor.network import _rope
    from target_actor.model import rms_norm

    cos, sin = rope.lookup(positions)
    x = rms_norm(h, layer.input_norm, layer.eps)
    hd = layer.head_dim
    q = rms_norm(layer.q_proj(x).view(N, K + 1, -1, hd), layer.q_norm, layer.eps)
    q = _rope(q, cos, sin)
    kb, vb = layer.kv(x, cos, sin)
    outs = []
    for n in range(N):
        heads = []
        for j in range(layer.heads):
            kv = j // layer.group
            keys = torch.cat([ctx.k[n, kv][ctx.mask[n]], g[j], kb[n, kv]])
            values = torch.cat([ctx.v[n, kv][ctx.mask[n]], ctx.summary_m[n, j], vb[n, kv]])
            p = torch.softmax(q[n, :, j] @ keys.T * layer.scale, -1)
            heads.append(p @ values)
        outs.append(torch.cat(heads, -1))
    h = h + layer.o_proj(torch.stack(outs))
    gate, up = layer.gate_up(rms_norm(h, layer.post_norm, layer.eps)).chunk(2, -1)
    return h + layer.down(torch.nn.functional.silu(gate) * up)


def test_layer_attention_matches_a_head_by_head_reference():
    net = make_net()
    ctx = make_contexts(net, torch.Generator().manual_seed(2))[0]
    x, positions = block(net)
    cos, sin = net.rope.lookup(positions)
    with torch.no_grad():
        ours = net.layers[0](x, cos, sin, ctx, net.summary_queries[0])
        ref = naive_layer(net.layers[0], net.rope, x, positions, ctx, net.summary_queries[0])
    assert (ours - ref).abs().max() <= 1e-5


def test_block_is_non_causal_and_context_rows_are_unordered():
    net = make_net()
    gen = torch.Generator().manual_seed(3)
    ctxs = make_contexts(net, gen)
    x, positions = block(net)
    with torch.no_grad():
        ref = net(x, positions, ctxs)
        x2 = x.clone()
        x2[:, -1] += 1.0  # the last MASK slot changes ...
        assert (net(x2, positions, ctxs)[:, 0] - ref[:, 0]).abs().max() > 1e-4  # ... slot 0 sees it
        perm = torch.randperm(C + 2, generator=gen)
        shuffled = [
            LayerContext(
                c.k[:, :, perm], c.v[:, :, perm], c.mask[:, perm], c.summary_m, c.summary_mask
            )
            for c in ctxs
        ]
        assert (
            net(x, positions, shuffled) - ref
        ).abs().max() <= 3e-5  # attention sums in another order
        junk = [
            LayerContext(
                c.k,
                c.v.masked_fill(~c.mask[:, None, :, None], 1e4),
                c.mask,
                c.summary_m,
                c.summary_mask,
            )
            for c in ctxs
        ]
        assert torch.equal(net(x, positions, junk), ref)  # masked rows weigh exactly 0


def test_empty_summary_slots_are_ignored():
    net = make_net()
    ctxs = make_contexts(net, torch.Generator().manual_seed(4))
    x, positions = block(net)
    with torch.no_grad():
        masked = [
            LayerContext(c.k, c.v, c.mask, c.summary_m, torch.zeros_like(c.summary_mask))
            for c in ctxs
        ]
        absent = [LayerContext(c.k, c.v, c.mask) for c in ctxs]
        assert torch.allclose(net(x, positions, masked), net(x, positions, absent), atol=1e-5)


def as_refs(ctxs: list[LayerContext]) -> list[LayerContext]:
    """The same contexts as the drafter holds them on the host: per-sequence buffers
    ``[L, ...]`` read by address (``ContextRefs``), an empty slot's lambda -inf."""
    per_seq = [
        (
            torch.stack([c.k[n] for c in ctxs]).contiguous(),
            torch.stack([c.v[n] for c in ctxs]).contiguous(),
            torch.stack([c.summary_m[n] for c in ctxs]).contiguous(),
            torch.stack(
                [torch.where(c.summary_mask[n], 0.0, float("-inf")) for c in ctxs]
            ).contiguous(),
        )
        for n in range(ctxs[0].mask.shape[0])
    ]
    refs = ContextRefs.of(per_seq)
    return [LayerContext(None, None, c.mask, refs=refs, layer=i) for i, c in enumerate(ctxs)]


@pytest.mark.skipif(not native.available(), reason="needs the C kernels")
def test_c_attention_over_each_sequences_buffers_matches_torchs():
    """The host's one-call attention (``ls_draft_attend``) reads each sequence's own
    buffers and gives torch's block pass, masked rows and empty summary slots included."""
    net = make_net()
    ctxs = make_contexts(net, torch.Generator().manual_seed(5))
    ctxs[1].summary_mask[0, 1, 2:] = False  # some empty slots
    ctxs[1].summary_mask[2, 0] = False
    x, positions = block(net)
    with torch.no_grad():
        ref = net(x, positions, ctxs)
        assert (net(x, positions, as_refs(ctxs)) - ref).abs().max() <= 1e-5
        junk = [  # masked rows weigh exactly 0 here too
            LayerContext(c.k, c.v.masked_fill(~c.mask[:, None, :, None], 1e4), c.mask,
                         c.summary_m, c.summary_mask)
            for c in ctxs
        ]  # fmt: skip
        assert torch.equal(net(x, positions, as_refs(junk)), net(x, positions, as_refs(ctxs)))


def chain_head(vocab: int = 10) -> MarkovHead:
    """A Markov head whose bias strongly prefers token (prev + 1) % vocab."""
    head = MarkovHead(vocab, vocab + 1)
    with torch.no_grad():
        head.w1.copy_(torch.eye(vocab + 1, vocab + 1))
        nxt = torch.zeros(vocab + 1, vocab)
        nxt[torch.arange(vocab), (torch.arange(vocab) + 1) % vocab] = 20.0
        head.w2.copy_(nxt)
    return head


def test_markov_head_conditions_each_slot_on_the_token_before():
    head = chain_head()
    base = torch.zeros(2, 6, 10)
    anchor = torch.tensor([3, 10])  # 10: an anchor outside the draft vocabulary
    base[1, 0, 7] = 5.0  # slot 1 of row 1: only the base logits decide
    tokens, q_ids, q_probs = sample_block(base, anchor, head, torch.zeros(2), torch.zeros(2, 6), 4)
    assert tokens[0].tolist() == [4, 5, 6, 7, 8, 9]
    assert tokens[1].tolist() == [7, 8, 9, 0, 1, 2]
    assert (q_probs[..., 0] == 1).all() and (q_probs[..., 1:] == 0).all()
    assert torch.equal(q_ids[..., 0], tokens)


def test_sampling_draws_from_the_truncated_renormalised_proposal():
    head = MarkovHead(12, 3)
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(1, 1, 12, generator=gen).expand(20_000, 1, 12).contiguous()
    temperature = torch.full((20_000,), 0.7)
    u = torch.rand(20_000, 1, generator=gen)
    tokens, q_ids, q_probs = sample_block(
        base, torch.zeros(20_000, dtype=torch.long), head, temperature, u, 5
    )
    top, ids = (base[0, 0] / 0.7).topk(5)
    assert torch.equal(q_ids[0, 0], ids)
    assert torch.allclose(q_probs[0, 0], torch.softmax(top, -1), atol=1e-6)
    freq = torch.stack([(tokens[:, 0] == i).float().mean() for i in ids])
    assert (freq - q_probs[0, 0]).abs().max() < 0.015
    assert set(tokens[:, 0].tolist()) <= set(ids.tolist())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_proposal_never_draws_a_zero_probability_entry(temperature):
    head = MarkovHead(6, 2)
    base = torch.tensor([[[0.0, -200.0, -300.0, -400.0, -500.0, -600.0]]])  # tail underflows
    u = torch.full((1, 1), 0.999999)
    tokens, q_ids, q_probs = sample_block(
        base, torch.tensor([0]), head, torch.tensor([temperature]), u, 4
    )
    picked = q_probs[0, 0][q_ids[0, 0] == tokens[0, 0]]
    assert picked.item() > 0
