"""Drafter training on a tiny random target: views, summary scan, branches, loop, resume."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafter_actor.config import DrafterConfig
from drafter_actor.context_copy import MAX_NGRAM, copy_inputs, find_copy
from drafter_actor.drafter import Drafter
from drafter_actor.training import TrainConfig, TrainError, evaluate_tau, train_drafter
from drafter_actor.training.carryover import greedy_drafts, shift_anchors
from drafter_actor.training.checkpoint import saved_drafter
from drafter_actor.training.data import Record, Sequence, draft_vocabulary, to_sequence
from drafter_actor.training.evaluate import _walk
from drafter_actor.training.grow import grow_weights
from drafter_actor.training.objective import block_loss, slot_weights
from drafter_actor.training.revocab import remap_draft_vocab
from drafter_actor.training.target_pass import TargetPass
from drafter_actor.training.views import (
    Anchors,
    Batch,
    block_logits,
    build_views,
    prefix_summary,
)
from target_actor.batch import ForwardBatch
from target_actor.config import ModelConfig
from target_actor.messages import DraftRequest
from target_actor.runner import TargetRunner, TargetSpec
from target_actor.summary import build_prefill_views, build_round_update, update_summary
from tests.conftest import make_tiny_checkpoint

VOCAB, EOS = 97, 2


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: with other processes on the two cores, two threads wait on each
    other at every op (tiny ops take milliseconds); one thread is 10-100x faster here."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A tiny llama with 8 layers (4 tapped) and 256 positions.

    Its LM head is scaled up so that its logits spread like a trained model's (the random
    init gives logits of ~0.2, which no drafter can sharpen); argmaxes are unchanged.
    """
    folder = make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny8") / "llama", "llama", num_hidden_layers=8
    )
    path = folder / "model.safetensors"
    weights = load_file(str(path))
    weights["lm_head.weight"] = weights["lm_head.weight"] * 40
    save_file(weights, str(path), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def runner(target_dir):
    return TargetRunner(TargetSpec(str(target_dir)))


def greedy_records(runner: TargetRunner, n: int, new: int, seed: int) -> list[Record]:
    """``n`` random prompts answered greedily by the target (what the real data holds)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(
            3, VOCAB, (int(torch.randint(4, 24, (1,), generator=gen)),), generator=gen
        ).tolist()
        for _ in range(n)
    ]
    ids = list(range(1000, 1000 + n))
    out = runner.forward(
        ForwardBatch(
            ids,
            torch.tensor([t for p in prompts for t in p]),
            [len(p) for p in prompts],
            [0] * n,
            [1] * n,
        )
    )
    responses = [[int(t)] for t in out.logits.argmax(-1)]
    for _ in range(new - 1):
        out = runner.forward(
            ForwardBatch(
                ids,
                torch.tensor([r[-1] for r in responses]),
                [1] * n,
                [len(p) + len(r) - 1 for p, r in zip(prompts, responses, strict=True)],
                [1] * n,
            )
        )
        for r, t in zip(responses, out.logits.argmax(-1).tolist(), strict=True):
            r.append(t)
    runner.free(ids)
    return [
        Record(f"r{seed}-{i}", p, r, "stop" if i % 3 == 0 else "length")
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True))
    ]


def write_data(folder, records: list[Record], per_shard: int = 8) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "manifest.json").write_text(json.dumps({"vocab_size": VOCAB, "eos_token_ids": [EOS]}))
    for s in range(0, len(records), per_shard):
        lines = [json.dumps(dataclasses.asdict(r)) for r in records[s : s + per_shard]]
        (folder / f"shard-{s // per_shard:05d}.jsonl").write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def data_dir(runner, tmp_path_factory):
    folder = tmp_path_factory.mktemp("data") / "tiny"
    write_data(folder, greedy_records(runner, 20, 40, seed=0))
    return folder


def small_config(data_dir, out, **kw) -> TrainConfig:
    base = dict(
        data_dir=str(data_dir),
        out=str(out),
        max_len=128,
        eval_seqs=4,
        window=16,
        summary_slots=4,
        markov_rank=16,
        draft_vocab=48,
        k=4,
        anchors_per_seq=16,
        seqs_per_step=4,
        summary_chunk=8,
        steps=50,
        lr=3e-3,
        warmup_ratio=0.1,
        ckpt_every=0,
        progress=False,
        init_std=0.05,
        cache_dtype="float32",
        threads=1,
    )
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def trained(target_dir, data_dir, tmp_path_factory):
    """A 50-step baseline run (loss, resume and evaluation tests share it)."""
    out = tmp_path_factory.mktemp("run") / "baseline"
    train_drafter(small_config(data_dir, out, target=str(target_dir)))
    return out


def taps_of(tpass: TargetPass, tokens: list[int]):
    h, k, v = tpass.taps([tokens])[0]
    return torch.tensor(tokens), h, k, v


# -- the target passes ----------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tap_pass_equals_the_runner_taps(tiny_checkpoints, arch):
    runner = TargetRunner(TargetSpec(str(tiny_checkpoints[arch])))
    tpass = TargetPass(runner.model)
    seqs = [list(range(3, 40)), list(range(50, 61))]
    for (h, k, v), tokens in zip(tpass.taps(seqs), seqs, strict=True):
        out = runner.forward(ForwardBatch.single(7, tokens, 0, 0, taps=True))
        runner.free([7])
        assert torch.allclose(h, out.tap_hidden, atol=1e-4)
        assert torch.allclose(k, out.tap_k.transpose(0, 1), atol=1e-5)
        assert torch.allclose(v, out.tap_v.transpose(0, 1), atol=1e-5)


def test_parallel_branches_equal_verifying_each_branch_alone(runner, data_dir):
    rec = greedy_records(runner, 1, 40, seed=5)[0]
    tokens = rec.prompt_ids + rec.response_ids
    P, k = len(rec.prompt_ids), 5
    anchors = torch.tensor([P, P + 3, P + 7, P + 11, P + 20, P + 30])
    gen = torch.Generator().manual_seed(1)
    drafts = torch.stack([torch.tensor(tokens[a + 1 : a + 1 + k]) for a in anchors.tolist()])
    for i, wrong_at in enumerate([0, 2, None, 4, 1, 3]):  # None: the recorded continuation
        if wrong_at is not None:
            drafts[i, wrong_at] = (
                drafts[i, wrong_at] + 1 + torch.randint(90, (1,), generator=gen)
            ) % VOCAB
    drafts[5, 4] = (drafts[5, 4] + 5) % VOCAB  # rejected tokens after a rejection as well
    accepted, branch_taps = TargetPass(runner.model).verify_branches(
        torch.tensor(tokens), anchors, drafts
    )
    alone = []
    for i, a in enumerate(anchors.tolist()):
        block = [tokens[a], *drafts[i].tolist()]
        out = runner.forward(ForwardBatch.single(9, tokens[:a] + block, 0, k + 1, taps=True))
        runner.free([9])
        match = (out.logits[:k].argmax(-1) == drafts[i]).long().cumprod(0)
        alone.append(int(match.sum()))
        assert torch.allclose(branch_taps[i], out.tap_hidden[a:], atol=1e-4)
    assert accepted.tolist() == alone
    assert 0 in alone and k in alone and len(set(alone)) >= 3


# -- the views ----------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 8, 32])
def test_prefix_scan_summary_equals_the_incremental_merge(runner, chunk):
    tpass = TargetPass(runner.model)
    seqs = [list(range(3, 90)), list(range(10, 60))]
    batch = Batch.collate([taps_of(tpass, s) for s in seqs])
    g = torch.randn(4, 4, 5, 16, generator=torch.Generator().manual_seed(0)) * 3
    anchors = Anchors.pad(
        [torch.tensor([1, 2, 8, 9, 31, 32, 33, 86]), torch.tensor([1, 7, 16, 49])]
    )
    m, lam = prefix_summary(g, batch.k, batch.v, anchors.pos, 0.25, chunk)
    for b in range(2):
        rows_k = batch.k[b].transpose(0, 1)  # [L, T, H_kv, hd]
        rows_v = batch.v[b].transpose(0, 1)
        for j, a in enumerate(anchors.pos[b].tolist()):
            if not anchors.mask[b, j]:
                continue
            # as inference builds it: a prefill chunk, then per-round merges of a few rows
            cut = a // 2
            m_ref, lam_ref = update_summary(
                torch.zeros(4, 4, 5, 16),
                torch.full((4, 4, 5), float("-inf")),
                g,
                rows_k[:, :cut],
                rows_v[:, :cut],
                0.25,
            )
            for s in range(cut, a, 3):
                e = min(a, s + 3)
                m_ref, lam_ref = update_summary(
                    m_ref, lam_ref, g, rows_k[:, s:e], rows_v[:, s:e], 0.25
                )
            assert torch.allclose(m[b, j], m_ref, atol=1e-5, rtol=1e-5)
            assert torch.allclose(lam[b, j], lam_ref, atol=1e-5, rtol=1e-5)


def test_prefix_scan_gradient_is_finite():
    gen = torch.Generator().manual_seed(3)
    k, v = (
        torch.randn(2, 40, 2, 1, 8, generator=gen) * 30,
        torch.randn(2, 40, 2, 1, 8, generator=gen),
    )
    g = torch.randn(2, 2, 3, 8, generator=gen).requires_grad_()
    anchors = Anchors.pad([torch.tensor([1, 5, 16, 39]), torch.tensor([2])])
    m, lam = prefix_summary(g, k, v, anchors.pos, 1.0, 8)
    (m.sum() + lam[anchors.mask].sum()).backward()
    assert torch.isfinite(g.grad).all() and g.grad.abs().sum() > 0


def inference_base_logits(drafter: Drafter, anchor: int, position: int, k: int) -> torch.Tensor:
    """The base logits ``draft_block`` computes for the sequence's current views."""
    net = drafter.net
    state = drafter.state(0)
    ctx = drafter._contexts([state])
    boundary = net.fuse(state.boundary.unsqueeze(0)) if net.cfg.boundary_input else None
    copies = (
        copy_inputs([find_copy(state.recent_tokens(), anchor, k)], k)
        if net.cfg.copy_input
        else None
    )
    positions = (position + torch.arange(k + 1)).unsqueeze(0)
    h = net(net.embed_block(torch.tensor([anchor]), k, boundary, copies), positions, ctx)
    return net.logits(h[:, 1:])[0]


def add_boundary_input(drafter: Drafter, seed: int = 0) -> None:
    """Give a trained drafter a random (non-zero) boundary input projection."""
    d = drafter.cfg.target.hidden_size
    drafter.cfg = drafter.net.cfg = dataclasses.replace(drafter.cfg, boundary_input=True)
    drafter.net.boundary_proj = torch.nn.Linear(d, d, bias=False)
    with torch.no_grad():
        w = torch.randn(d, d, generator=torch.Generator().manual_seed(seed)) * 0.05
        drafter.net.boundary_proj.weight.copy_(w)


def add_copy_input(drafter: Drafter, seed: int = 0) -> None:
    """Give a trained drafter random (non-zero) context-copy input weights."""
    d = drafter.cfg.target.hidden_size
    drafter.cfg = drafter.net.cfg = dataclasses.replace(drafter.cfg, copy_input=True)
    gen = torch.Generator().manual_seed(seed)
    drafter.net.copy_proj = torch.nn.Linear(d, d, bias=False)
    drafter.net.copy_bias = torch.nn.Parameter(torch.randn(MAX_NGRAM + 1, d, generator=gen))
    with torch.no_grad():
        drafter.net.copy_proj.weight.copy_(torch.randn(d, d, generator=gen) * 0.05)


@pytest.mark.parametrize("extra_input", [None, "boundary", "copy"])
def test_training_logits_equal_inference_logits_at_every_anchor(
    trained, target_dir, runner, extra_input
):
    """Prefill + verify rounds at inference vs. the parallel views of training (window 16)."""
    drafter = Drafter.from_pretrained(trained, target_dir)
    if extra_input == "boundary":
        add_boundary_input(drafter)
    if extra_input == "copy":
        add_copy_input(drafter)
    net, k, W = drafter.net, drafter.cfg.block_size, drafter.cfg.window
    rec = greedy_records(runner, 1, 60, seed=9)[0]
    tokens = rec.prompt_ids + rec.response_ids
    P = len(rec.prompt_ids)
    tpass = TargetPass(runner.model)
    batch = Batch.collate([taps_of(tpass, tokens)])
    # inference: prefill the prompt, then rounds accepting the recorded tokens, 2 or k at a time
    out = runner.forward(ForwardBatch.single(0, tokens[:P], 0, 1, taps=True))
    g = drafter.summary_queries()
    views = build_prefill_views(0, out.tap_k, out.tap_v, out.tap_hidden, g, W, tokens=tokens[:P])
    drafter.prefill([views])
    t, checked, matched = P, [], 0
    with torch.no_grad():
        for accept in [2, k, 0, 1, k, k, 3, k, 2, k]:
            train_logits = block_logits(
                net, build_views(net, batch, Anchors.pad([torch.tensor([t])]), 8), batch, k
            )[0]
            infer = inference_base_logits(drafter, tokens[t], t, k)
            assert torch.allclose(train_logits, infer, atol=1e-4), (
                t,
                (train_logits - infer).abs().max(),
            )
            checked.append(t)
            matched += find_copy(drafter.state(0).recent_tokens(), tokens[t], k)[1] > 0
            block = tokens[t : t + k + 1]
            out = runner.forward(ForwardBatch.single(0, block, t, k + 1, taps=True))
            drafter.apply_updates(
                [build_round_update(0, t, accept, out.tap_k, out.tap_v, out.tap_hidden, block)]
            )
            t += accept + 1
    runner.free([0])
    assert checked[-1] > P + W  # the window has wrapped around its ring
    assert matched > 0  # some anchors had a context-copy candidate


def test_carry_views_equal_inference_after_a_rejecting_round(target_dir, runner):
    """Carryover: the second draft's views (shifted anchor + carry rows) = the drafter's state."""
    k, W = 5, 8
    cfg = DrafterConfig.for_target(runner.cfg, window=W, block_size=k, summary_slots=4, carry=True)
    d2t = torch.arange(0, VOCAB, 2)
    cfg = dataclasses.replace(cfg, draft_vocab_size=len(d2t))
    drafter = Drafter.random(target_dir, cfg, seed=1, init_std=0.2, d2t=d2t)
    net = drafter.net
    rec = greedy_records(runner, 1, 50, seed=11)[0]
    tokens = rec.prompt_ids + rec.response_ids
    P = len(rec.prompt_ids)
    tpass = TargetPass(runner.model)
    batch = Batch.collate([taps_of(tpass, tokens)])
    anchors = Anchors.pad([torch.tensor([P + 4, P + 10, P + 17, P + 25])])
    with torch.no_grad():
        views = build_views(net, batch, anchors, 8)
        drafts = greedy_drafts(net, block_logits(net, views, batch, k), batch.tokens[0, views.pos])
        drafts[:2, :2] = torch.tensor([tokens[a + 1 : a + 3] for a in views.pos[:2].tolist()])
        drafts[2] = torch.tensor(tokens[views.pos[2] + 1 : views.pos[2] + 1 + k])  # fully accepted
        accepted, branch = tpass.verify_branches(batch.tokens[0], views.pos, drafts)
        shifted, carry, carry_mask = shift_anchors(
            anchors, views.pos, accepted, branch, batch.lengths[views.seq]
        )
        views2 = build_views(net, batch, shifted, 8, carry, carry_mask)
        train = block_logits(net, views2, batch, k)
    assert accepted[2] == k and accepted.min() < k
    for i, a in enumerate(views.pos.tolist()):
        prefix = tokens[:a]
        out = runner.forward(ForwardBatch.single(0, prefix, 0, 1, taps=True))
        drafter.prefill(
            [
                build_prefill_views(
                    0, out.tap_k, out.tap_v, out.tap_hidden, drafter.summary_queries(), W
                )
            ]
        )
        block = [tokens[a], *drafts[i].tolist()]
        out = runner.forward(ForwardBatch.single(0, block, a, k + 1, taps=True))
        m = int((out.logits[:k].argmax(-1) == drafts[i]).long().cumprod(0).sum())
        assert m == accepted[i]
        drafter.apply_updates([build_round_update(0, a, m, out.tap_k, out.tap_v, out.tap_hidden)])
        assert drafter.state(0).carry_len == k - m
        a2 = a + m + 1
        assert views2.pos[i] == a2
        with torch.no_grad():
            infer = inference_base_logits(drafter, tokens[a2], a2, k)
        assert torch.allclose(train[i], infer, atol=1e-4), (i, (train[i] - infer).abs().max())
        runner.free([0])


# -- the loss and the data ------------------------------------------------------------------


def test_slot_weights_and_loss_ignore_labels_outside_the_draft_vocabulary(target_dir):
    cfg = DrafterConfig.for_target(
        ModelConfig.from_pretrained(target_dir), block_size=3, draft_vocab_size=10
    )
    drafter = Drafter.random(target_dir, cfg, d2t=torch.arange(10, 20))
    net = drafter.net
    assert torch.allclose(slot_weights(3, 4.0), torch.tensor([1.0, 0.7788008, 0.6065307]))
    base = torch.randn(2, 3, 10, requires_grad=True)
    labels = torch.tensor([[12, 50, 13], [11, 12, 19]])  # 50 is outside the draft vocabulary
    valid = torch.tensor([[True, True, True], [True, True, False]])
    loss, stats = block_loss(net, base, torch.tensor([10, 15]), labels, valid, 4.0)
    loss.backward()
    assert base.grad[0, 1].abs().sum() == 0 and base.grad[1, 2].abs().sum() == 0
    assert base.grad[0, 0].abs().sum() > 0
    assert stats.counted.tolist() == [2, 2, 1] and stats.accepted.numel() == 1


def test_draft_vocabulary_takes_the_most_frequent_response_tokens_and_eos():
    seqs = [Sequence("a", [90, 91, 5, 5, 5, 6, 6, 7], 2), Sequence("b", [92, 5, 6, 8], 1)]
    d2t, coverage = draft_vocabulary(seqs, 3, VOCAB, always=(EOS,))
    assert d2t.tolist() == [2, 5, 6] and coverage == pytest.approx(7 / 9)
    assert draft_vocabulary(seqs, 0, VOCAB)[0].tolist() == list(range(VOCAB))
    long = to_sequence(Record("x", list(range(50)), list(range(30)), "stop"), 40, EOS)
    assert len(long.tokens) == 40 and long.tokens[long.prompt_len :][:3] == [0, 1, 2]
    assert long.prompt_len == 20  # the prompt is cut from the left, leaving half for the response


# -- the loop ---------------------------------------------------------------------------------


def read_log(out) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def test_loss_falls_over_50_steps_and_the_drafter_loads(trained, target_dir):
    rows = read_log(trained)
    assert [r["step"] for r in rows] == list(range(1, 51))
    first = sum(r["loss"] for r in rows[:5]) / 5
    last = sum(r["loss"] for r in rows[-5:]) / 5
    assert last < 0.7 * first, (first, last)
    assert rows[-1]["tau"] > rows[0]["tau"]
    drafter = Drafter.from_pretrained(trained, target_dir)  # the engine's loader
    assert drafter.cfg.block_size == 4 and drafter.cfg.draft_vocab_size == 48
    assert not drafter.cfg.carry
    info = json.loads((trained / "train_config.json").read_text())
    assert info["num_heldout_seqs"] == 4 and info["draft_vocab_coverage"] > 0.5
    proposal = drafter.propose([], 4)
    assert proposal.tokens.shape == (0, 4)


def test_resume_repeats_the_next_step_bit_exactly(target_dir, runner, data_dir, trained, tmp_path):
    cache = trained / "tap_cache"
    a, b = tmp_path / "a", tmp_path / "b"
    kw = dict(target=str(target_dir), steps=4, ckpt_every=2, keep_ckpts=5, cache_dir=str(cache))
    train_drafter(small_config(data_dir, a, **kw))
    (b / "ckpt").mkdir(parents=True)
    shutil.copytree(a / "ckpt" / "step-0000002", b / "ckpt" / "step-0000002")
    with pytest.raises(TrainError, match="resume"):
        train_drafter(small_config(data_dir, b, **kw))
    grown = tmp_path / "grown"  # data generation went on meanwhile: the run keeps its split
    shutil.copytree(data_dir, grown)
    write_data(tmp_path / "more", greedy_records(runner, 3, 20, seed=7))
    shutil.copy(tmp_path / "more" / "shard-00000.jsonl", grown / "shard-00099.jsonl")
    train_drafter(small_config(grown, b, resume=True, **kw))
    rows_a, rows_b = read_log(a), read_log(b)
    assert [r["step"] for r in rows_b] == [3, 4]
    for ra, rb in zip(rows_a[2:], rows_b, strict=True):
        assert (
            ra["loss"] == rb["loss"]
            and ra["acc"] == rb["acc"]
            and ra["grad_norm"] == rb["grad_norm"]
        )
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[n], wb[n]) for n in wa)
    with pytest.raises(TrainError, match="other settings"):
        train_drafter(small_config(data_dir, b, resume=True, **{**kw, "steps": 6, "lr": 1e-3}))


@pytest.mark.parametrize("extra_input", ["boundary_input", "copy_input"])
def test_an_added_input_extends_a_trained_drafter(
    target_dir, data_dir, trained, tmp_path, extra_input
):
    kw = dict(target=str(target_dir), init_from=str(trained), steps=2)
    kw["cache_dir"] = str(trained / "tap_cache")
    plain, extended = tmp_path / "plain", tmp_path / "extended"
    train_drafter(small_config(data_dir, plain, **kw))
    train_drafter(small_config(data_dir, extended, **{extra_input: True}, **kw))
    if extra_input == "boundary_input":  # starts at zero: the first step is the old one's
        assert read_log(extended)[0]["loss"] == read_log(plain)[0]["loss"]
    drafter = Drafter.from_pretrained(extended, target_dir)
    assert getattr(drafter.cfg, extra_input)
    added = drafter.net.boundary_proj if extra_input == "boundary_input" else drafter.net.copy_proj
    assert added.weight.abs().sum() > 0
    proposal = drafter.propose([], 4)
    assert proposal.tokens.shape == (0, 4)


def test_revocab_moves_the_markov_rows_onto_the_new_vocabulary(trained):
    weights = load_file(str(trained / "model.safetensors"))
    old = weights["d2t"]
    unused = [t for t in range(VOCAB) if t not in set(old.tolist())]
    new = torch.tensor(sorted(set(old[::2].tolist()) | set(unused[:7])))  # half kept, 7 new
    moved = remap_draft_vocab(weights, new)
    assert torch.equal(moved["d2t"], new) and moved["markov.w1"].shape[0] == len(new) + 1
    for j, t in enumerate(new.tolist()):
        i = (old == t).nonzero()
        if len(i):  # kept: the learned row and column
            assert torch.equal(moved["markov.w1"][j], weights["markov.w1"][int(i)])
            assert torch.equal(moved["markov.w2"][:, j], weights["markov.w2"][:, int(i)])
        else:  # new: no correction yet
            assert not moved["markov.w1"][j].any() and not moved["markov.w2"][:, j].any()
    assert torch.equal(moved["markov.w1"][-1], weights["markov.w1"][-1])  # out of vocabulary
    back = remap_draft_vocab(remap_draft_vocab(weights, torch.arange(VOCAB)), old)
    assert all(torch.equal(back[n], weights[n]) for n in ("d2t", "markov.w1", "markov.w2"))


def test_revocab_continues_a_drafter_on_the_data_s_own_vocabulary(
    target_dir, data_dir, trained, tmp_path
):
    out = tmp_path / "revocab"
    kw = dict(target=str(target_dir), init_from=str(trained), steps=2, revocab=True)
    train_drafter(
        small_config(data_dir, out, draft_vocab=64, **kw, cache_dir=str(trained / "tap_cache"))
    )
    drafter = Drafter.from_pretrained(out, target_dir)
    assert drafter.cfg.draft_vocab_size == 64 and len(drafter.net.d2t) == 64
    before = json.loads((trained / "train_config.json").read_text())["draft_vocab_coverage"]
    after = json.loads((out / "train_config.json").read_text())["draft_vocab_coverage"]
    assert after >= before  # the most frequent tokens of this data: never fewer covered
    assert drafter.propose([], 4).tokens.shape == (0, 4)


def test_growing_the_mlp_and_markov_rank_keeps_the_drafter_s_logits(target_dir, runner, trained):
    cfg, weights = saved_drafter(trained)
    grown_cfg, grown = grow_weights(cfg, weights, 2 * cfg.mlp_width, cfg.markov_rank + 8, 3, 0.2)
    assert grown_cfg.mlp_width == 2 * cfg.mlp_width and grown_cfg.markov_rank == cfg.markov_rank + 8
    nets = []
    for c, w in ((cfg, weights), (grown_cfg, grown)):
        net = Drafter.random(target_dir, c, seed=0, d2t=w["d2t"]).net
        net.load_state_dict(w)
        nets.append(net.eval())
    tpass = TargetPass(runner.model)
    batch = Batch.collate([taps_of(tpass, list(range(3, 70)))])
    anchors = Anchors.pad([torch.tensor([5, 20, 40, 60])])
    prev = torch.arange(cfg.draft_vocab_size + 1)
    with torch.no_grad():
        logits = [block_logits(n, build_views(n, batch, anchors, 8), batch, 4) for n in nets]
        bias = [n.markov(prev) for n in nets]
    assert torch.allclose(logits[0], logits[1], atol=1e-5)
    assert torch.allclose(bias[0], bias[1], atol=1e-6)
    with pytest.raises(TrainError, match="cannot shrink"):
        grow_weights(cfg, weights, cfg.mlp_width - 1, 0, 3, 0.2)
    with pytest.raises(TrainError, match="markov_rank .* cannot shrink"):
        grow_weights(cfg, weights, 0, cfg.markov_rank - 1, 3, 0.2)


def test_training_from_a_drafter_with_a_wider_mlp(target_dir, data_dir, trained, tmp_path):
    out = tmp_path / "wide"
    base_cfg = saved_drafter(trained)[0]
    kw = dict(target=str(target_dir), init_from=str(trained), steps=2)
    train_drafter(
        small_config(
            data_dir,
            out,
            mlp_width=2 * base_cfg.mlp_width,
            cache_dir=str(trained / "tap_cache"),
            **kw,
        )
    )
    drafter = Drafter.from_pretrained(out, target_dir)
    assert drafter.cfg.mlp_width == 2 * base_cfg.mlp_width
    assert drafter.net.layers[0].down.weight[:, base_cfg.mlp_width :].abs().sum() > 0  # it learns
    assert drafter.propose([], 4).tokens.shape == (0, 4)


def test_carryover_stage_continues_the_baseline(target_dir, data_dir, trained, tmp_path):
    out = tmp_path / "carry"
    cfg = small_config(
        data_dir,
        out,
        target=str(target_dir),
        carryover=True,
        init_from=str(trained),
        steps=3,
        cache_dir=str(trained / "tap_cache"),
    )
    train_drafter(cfg)
    rows = read_log(out)
    assert len(rows) == 3 and all(0 <= r["first_accepted"] <= 4 for r in rows)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    drafter = Drafter.from_pretrained(out, target_dir)
    assert drafter.cfg.carry
    base = load_file(str(trained / "model.safetensors"))
    after = load_file(str(out / "model.safetensors"))
    assert torch.equal(base["d2t"], after["d2t"])
    assert not torch.equal(base["carry_embedding"], after["carry_embedding"])  # E_carry trains


def test_carryover_first_weight_trains_the_first_draft_too(target_dir, data_dir, trained, tmp_path):
    """With ``carryover_first_weight`` the first draft's loss is the plain stage's loss."""
    common = dict(target=str(target_dir), init_from=str(trained), steps=1)
    common["cache_dir"] = str(trained / "tap_cache")
    train_drafter(small_config(data_dir, tmp_path / "plain", **common))
    carry = small_config(
        data_dir, tmp_path / "carry", carryover=True, carryover_first_weight=0.5, **common
    )
    train_drafter(carry)
    plain_row, carry_row = read_log(tmp_path / "plain")[0], read_log(tmp_path / "carry")[0]
    assert carry_row["first_loss"] == pytest.approx(plain_row["loss"], rel=1e-5)
    assert carry_row["first_tau"] == pytest.approx(plain_row["tau"])
    assert carry_row["loss"] > 0.5 * carry_row["first_loss"]  # plus the second draft's


def test_evaluate_tau_on_held_out_sequences(trained, data_dir, target_dir):
    result = evaluate_tau(trained, data_dir, num_seqs=4, k=4)
    assert result["num_seqs"] == 4 and result["num_anchors"] > 0 and result["k"] == 4
    assert 1 <= result["tau_rounds"] <= result["tau"] <= 5  # rounds favour hard stretches
    sampled = evaluate_tau(trained, data_dir, num_seqs=4, k=4, anchors_per_seq=8)
    assert sampled["tau_rounds"] is None and sampled["num_anchors"] <= 4 * 8
    at_least = result["accepted_at_least"]
    assert all(x >= y for x, y in zip(at_least, at_least[1:], strict=False))
    held = json.loads((trained / "holdout_ids.json").read_text())
    assert len(held) == 4


def test_the_round_walk_counts_rounds_as_greedy_decoding_does():
    # anchors 0..9: accept 2 at 0 -> next anchor 3; 0 at 3 -> 4; 4 at 4 -> 9; 0 at 9
    assert _walk([2, 9, 9, 0, 4, 9, 9, 9, 9, 0]) == (4, 6)
    assert _walk([]) == (0, 0)


# -- bad input ------------------------------------------------------------------------------


def one_line_error(fn) -> str:
    with pytest.raises(TrainError) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg and msg
    return msg


@pytest.mark.parametrize("k", [0, 17, -3])
def test_k_out_of_range_is_a_one_line_error(tmp_path, k):
    assert "k=" in one_line_error(lambda: TrainConfig(data_dir="d", out=str(tmp_path), k=k))


def test_bad_data_folders_are_one_line_errors(target_dir, data_dir, tmp_path):
    def run(folder):
        return lambda: train_drafter(small_config(folder, tmp_path / "out", target=str(target_dir)))

    assert "does not exist" in one_line_error(run(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "manifest.json" in one_line_error(run(empty))
    broken = tmp_path / "broken"
    shutil.copytree(data_dir, broken)
    (broken / "shard-00001.jsonl").write_text('{"id": "x", "prompt_ids": [1, 2]}\n')
    assert "shard-00001.jsonl:1" in one_line_error(run(broken))
    (broken / "shard-00001.jsonl").write_text(
        '{"id": "x", "prompt_ids": [1, 500], "response_ids": [3], "finish_reason": "stop"}\n'
    )
    assert "token ids" in one_line_error(run(broken))
    (broken / "manifest.json").write_text("{not json")
    assert "unreadable" in one_line_error(run(broken))
    assert "init_from" in one_line_error(
        lambda: TrainConfig(data_dir=str(data_dir), out=str(tmp_path), carryover=True)
    )
    assert "init_from" in one_line_error(
        lambda: TrainConfig(data_dir=str(data_dir), out=str(tmp_path), revocab=True)
    )
    for weight, carry in ((-1.0, True), (1.0, False)):
        bad = dict(carryover=carry, init_from="x", carryover_first_weight=weight)
        assert "carryover" in one_line_error(lambda b=bad: TrainConfig("d", str(tmp_path), **b))


def test_request_of_unknown_sequence_is_still_refused(trained, target_dir):
    """The trained drafter is an ordinary drafter: the engine's checks apply."""
    drafter = Drafter.from_pretrained(trained, target_dir)
    with pytest.raises(ValueError):
        drafter.propose([DraftRequest(5, 3, 10)], 4)


def test_every_config_field_is_a_cli_option_with_help(tmp_path):
    import argparse

    from drafter_actor.training import add_train_args, from_args

    parser = argparse.ArgumentParser()
    add_train_args(parser)
    assert all(a.help for a in parser._actions if a.dest != "help")
    ns = parser.parse_args(
        ["--data-dir", "d", "--out", str(tmp_path), "--k", "5", "--carryover", "--init-from", "x"]
    )
    cfg = from_args(ns)
    assert cfg.k == 5 and cfg.carryover and cfg.init_from == "x" and cfg.anchors_per_seq == 64
    assert cfg == TrainConfig(data_dir="d", out=str(tmp_path), k=5, carryover=True, init_from="x")


def test_tap_cache_is_reused_extended_and_rebuilt_when_stale(runner, tmp_path):
    from drafter_actor.training.tap_cache import build_tap_cache

    tpass = TargetPass(runner.model)
    seqs = [Sequence(f"s{i}", list(range(3 + i, 30 + 2 * i)), 5) for i in range(3)]
    cache, stats = build_tap_cache(tmp_path, seqs[:2], tpass, "float16", progress=False)
    assert stats["sequences"] == 2 and cache.get("s1")[1].dtype == torch.float16
    tokens, h, k, v = cache.get("s1")
    h_ref, k_ref, _ = tpass.taps([seqs[1].tokens])[0]
    assert tokens.tolist() == seqs[1].tokens and torch.allclose(
        h.float(), h_ref, atol=1e-2, rtol=1e-3
    )
    assert torch.allclose(k.float(), k_ref, atol=1e-2, rtol=1e-3)
    cache, stats = build_tap_cache(tmp_path, seqs, tpass, "float16", progress=False)
    assert stats["sequences"] == 1 and all(s.id in cache for s in seqs)  # only the new one
    changed = [seqs[0], Sequence("s1", seqs[1].tokens[:-3], 5)]  # other max_len: recomputed
    cache, stats = build_tap_cache(tmp_path, changed, tpass, "float16", progress=False)
    assert stats["sequences"] == 1 and cache.get("s1")[0].shape[0] == len(seqs[1].tokens) - 3
    cache, stats = build_tap_cache(tmp_path, changed, tpass, "float32", progress=False)
    assert stats["sequences"] == 2 and cache.get("s0")[1].dtype == torch.float32
    assert len(list(tmp_path.glob("part-*.safetensors"))) == 1  # stale parts are gone


def test_export_writes_drafter_weights_without_machine_paths(trained, target_dir, tmp_path):
    from drafter_actor.training.export import export_drafter

    out = tmp_path / "shipped"
    report = export_drafter(trained, out, "bfloat16")
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "training.json",
    ]
    stored = load_file(str(out / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in stored.values() if t.is_floating_point())
    assert not any(name.startswith(("embed", "lm_head")) for name in stored)  # target's, shared
    info = json.loads((out / "training.json").read_text())
    assert str(tmp_path) not in json.dumps(info) and "target_path" not in info
    assert report["bytes"] == (out / "model.safetensors").stat().st_size
    a = Drafter.from_pretrained(trained, target_dir).net
    shipped = Drafter.from_pretrained(out, target_dir)
    assert shipped.cfg.context_copy and not a.cfg.context_copy  # served with context copy
    b = shipped.net
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.allclose(x.float(), y.float(), rtol=1e-2, atol=1e-3), name
    assert shipped.cfg.copy_sure_ngram == 2  # the default rule unless asked
    tuned = export_drafter(trained, tmp_path / "tuned", copy_sure_ngram=4)["out"]
    assert Drafter.from_pretrained(tuned, target_dir).cfg.copy_sure_ngram == 4
    with pytest.raises(TrainError, match="no checkpoint at step 7"):
        export_drafter(trained, tmp_path / "x", step=7)
    with pytest.raises(TrainError, match="copy_sure_ngram"):
        export_drafter(trained, tmp_path / "y", copy_sure_ngram=0)


# -- text the target did not write: labels are its greedy next tokens -----------------------


def test_tap_pass_greedy_tokens_are_the_runner_argmax(runner):
    tpass = TargetPass(runner.model)
    seqs = [list(range(3, 40)), list(range(50, 61))]
    for (h, _, _, greedy), tokens in zip(tpass.taps(seqs, greedy=True), seqs, strict=True):
        out = runner.forward(ForwardBatch.single(7, tokens, 0, len(tokens)))
        runner.free([7])
        assert greedy.tolist() == out.logits.argmax(-1).tolist()
        assert h.shape[0] == len(tokens)


def test_labels_of_other_text_count_only_while_it_agrees_with_the_target():
    from drafter_actor.training.views import AnchorViews, block_labels

    tokens = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12])
    # the target's pick after each row: agrees with the text after rows 1, 2 and 4 only
    greedy = torch.tensor([30, 7, 8, 31, 10, 32, 33, 34])
    items = [
        (t, torch.zeros(len(t), 1, 2), torch.zeros(len(t), 1, 1, 2), torch.zeros(len(t), 1, 1, 2))
        for t in (tokens, tokens[:6])
    ]
    batch = Batch.collate(items, [greedy, None])
    views = AnchorViews([], torch.tensor([0, 0, 1]), torch.tensor([1, 3, 1]), torch.zeros(3, 2))
    labels, valid = block_labels(batch, views, 4)
    # anchor at row 1: slots predict rows 2..5; labels greedy[1..4]; rows 2, 3 agree, row 4 not
    assert labels[0].tolist() == [7, 8, 31, 10] and valid[0].tolist() == [True, True, True, False]
    # anchor at row 3: greedy[3..6]; row 4 holds 9, not the target's 31: only slot 1 counts
    assert labels[1].tolist() == [31, 10, 32, 33] and valid[1].tolist() == [
        True,
        False,
        False,
        False,
    ]
    # the target's own text: recorded tokens, valid up to the end
    assert labels[2].tolist() == [7, 8, 9, 10] and valid[2].tolist() == [True, True, True, True]


def test_tap_cache_keeps_greedy_tokens_for_other_text(runner, tmp_path):
    from drafter_actor.training.tap_cache import build_tap_cache

    tpass = TargetPass(runner.model)
    own = Sequence("own", list(range(3, 30)), 5)
    other = Sequence("other", list(range(10, 40)), 5, target_labels=True)
    cache, stats = build_tap_cache(tmp_path, [own], tpass, "float32", progress=False)
    assert cache.next_tokens("own") is None
    cache, stats = build_tap_cache(tmp_path, [own, other], tpass, "float32", progress=False)
    assert stats["sequences"] == 1  # only the new one
    assert (
        cache.next_tokens("other").tolist()
        == tpass.taps([other.tokens], greedy=True)[0][3].tolist()
    )
    relabel = Sequence("own", own.tokens, 5, target_labels=True)  # cached without greedy
    cache, stats = build_tap_cache(tmp_path, [relabel, other], tpass, "float32", progress=False)
    assert stats["sequences"] == 1 and cache.next_tokens("own") is not None


def reply_records(runner: TargetRunner, n: int) -> list[Record]:
    """Text the target did not write: its own answers with every third token changed."""
    records = greedy_records(runner, n, 30, seed=7)
    return [
        Record(
            f"reply-{i}",
            r.prompt_ids,
            [t if j % 3 else (t + 1) % VOCAB for j, t in enumerate(r.response_ids)],
            r.finish_reason,
        )
        for i, r in enumerate(records)
    ]


def test_training_on_target_text_and_other_text_together(target_dir, runner, data_dir, tmp_path):
    other = tmp_path / "replies"
    write_data(other, reply_records(runner, 12))
    manifest = json.loads((other / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps({**manifest, "responses": "sharegpt"}))
    out = tmp_path / "mixed"
    cfg = small_config(f"{data_dir},{other}", out, target=str(target_dir), steps=6)
    train_drafter(cfg)
    info = json.loads((out / "train_config.json").read_text())
    assert info["num_train_seqs"] == 20 - 4 + 12
    held = json.loads((out / "holdout_ids.json").read_text())
    assert len(held) == 4 and not any(h.startswith("reply-") for h in held)  # own text only
    assert evaluate_tau(out, cfg.data_dir)["num_seqs"] == 4
    rows = read_log(out)
    assert len(rows) == 6 and all(r["loss"] == r["loss"] for r in rows)  # finite


def test_a_record_id_in_two_data_folders_is_a_one_line_error(target_dir, data_dir, tmp_path):
    cfg = small_config(f"{data_dir},{data_dir}", tmp_path / "dup", target=str(target_dir))
    assert "also in another folder" in one_line_error(lambda: train_drafter(cfg))


def test_data_repeat_visits_a_folder_more_often(runner, tmp_path):
    from drafter_actor.training.data import read_sequences, repeat_by_folder

    write_data(tmp_path / "a", greedy_records(runner, 3, 20, seed=5))
    write_data(
        tmp_path / "b",
        [dataclasses.replace(r, id=f"b-{r.id}") for r in greedy_records(runner, 2, 20, seed=6)],
    )
    spec = f"{tmp_path}/a,{tmp_path}/b"
    seqs = read_sequences(spec, VOCAB, 128)
    assert [s.folder for s in seqs] == [0, 0, 0, 1, 1]
    cfg = TrainConfig(data_dir=spec, out=str(tmp_path / "out"), data_repeat="1,3")
    epoch = repeat_by_folder(seqs, cfg.repeats())
    assert [s.id for s in epoch].count(seqs[3].id) == 3 and len(epoch) == 3 + 2 * 3
    assert repeat_by_folder(seqs, TrainConfig(data_dir=spec, out="o").repeats()) == seqs
    for bad in ("1", "1,0", "1,x"):
        msg = one_line_error(lambda b=bad: TrainConfig(data_dir=spec, out="o", data_repeat=b))
        assert "data_repeat" in msg


def test_the_targets_answer_replaces_a_reply_to_the_same_prompt(runner, tmp_path):
    from drafter_actor.training.data import read_sequences

    own = greedy_records(runner, 3, 20, seed=5)
    replies = [dataclasses.replace(r, id=own[i].id) for i, r in enumerate(reply_records(runner, 2))]
    replies.append(dataclasses.replace(replies[0], id="reply-only"))
    write_data(tmp_path / "own", own)
    write_data(tmp_path / "replies", replies)
    manifest = json.loads((tmp_path / "replies" / "manifest.json").read_text())
    (tmp_path / "replies" / "manifest.json").write_text(
        json.dumps({**manifest, "responses": "sharegpt"})
    )
    for spec in (f"{tmp_path}/own,{tmp_path}/replies", f"{tmp_path}/replies,{tmp_path}/own"):
        seqs = {s.id: s for s in read_sequences(spec, VOCAB, 128)}
        assert sorted(seqs) == sorted([r.id for r in own] + ["reply-only"])
        for r in own:  # the target's own text, with its recorded labels
            assert not seqs[r.id].target_labels
            assert seqs[r.id].tokens[seqs[r.id].prompt_len :][: len(r.response_ids)] == list(
                r.response_ids
            )
        assert seqs["reply-only"].target_labels
