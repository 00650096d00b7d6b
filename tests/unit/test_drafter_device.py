"""The drafter on a chosen torch device, checked on the host: every tensor the round path
makes names its device (so the same code places them on a GPU), messages move on
arrival, answers come back in host memory, and ``device="cpu"`` drafts as before."""

from __future__ import annotations

import pytest
import torch

from drafter_actor.baseline import FullPrefixDrafter, FullPrefixUpdate, FullPrefixViews
from drafter_actor.config import DrafterConfig, DrafterConfigError
from drafter_actor.drafter import Drafter
from drafter_actor.worker import (
    DrafterSpec,
    DrafterWorker,
    RayDrafter,
    drafter_device,
    drafter_dtype,
)
from target_actor.config import ModelConfig
from target_actor.messages import DraftRequest, PrefillViews, Proposal, RoundUpdate
from tests.conftest import make_tiny_checkpoint
from tests.device_check import unplaced_factories

K, W, PERIOD = 5, 8, 11


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny8") / "llama", "llama", num_hidden_layers=8
    )


def drafter(target_dir, device="cpu", **overrides) -> Drafter:
    cfg = DrafterConfig.for_target(
        ModelConfig.from_pretrained(target_dir), window=W, block_size=K, **overrides
    )
    return Drafter.random(target_dir, cfg, seed=0, init_std=0.2, device=device)


def random_views(
    cfg: DrafterConfig,
    seq_id: int,
    length: int,
    gen: torch.Generator,
    seed: int | None = None,
    tokens: torch.Tensor | None = None,
) -> PrefillViews:
    """Host views of random rows for a prompt of ``length`` tokens."""
    t, L, w = cfg.target, cfg.num_layers, min(cfg.window, length)
    return PrefillViews(
        seq_id=seq_id,
        length=length,
        window_k=torch.randn(L, w, t.num_kv_heads, t.head_dim, generator=gen),
        window_v=torch.randn(L, w, t.num_kv_heads, t.head_dim, generator=gen),
        summary_m=torch.randn(L, t.num_heads, cfg.summary_slots, t.head_dim, generator=gen),
        summary_lam=torch.randn(L, t.num_heads, cfg.summary_slots, generator=gen),
        boundary=torch.randn(L, t.hidden_size, generator=gen),
        seed=seed,
        tokens=tokens,
    )


def views(cfg: DrafterConfig, seq_id: int, length: int, gen: torch.Generator) -> PrefillViews:
    """Views of a prompt whose ids repeat with period ``PERIOD`` (context copy finds
    matches); odd sequences bring their own seed, even ones draw one from the drafter."""
    ids = torch.tensor([(3 * seq_id + j) % PERIOD for j in range(length)])
    return random_views(cfg, seq_id, length, gen, seq_id if seq_id % 2 else None, ids)


def update(cfg, seq_id, length, ids: list[int], gen) -> RoundUpdate:
    """The round that committed ``ids`` (the anchor and ``len(ids) - 1`` drafts) at ``length``."""
    t, L, m = cfg.target, cfg.num_layers, len(ids) - 1
    return RoundUpdate(
        seq_id=seq_id,
        length=length + m + 1,
        committed_k=torch.randn(L, m + 1, t.num_kv_heads, t.head_dim, generator=gen),
        committed_v=torch.randn(L, m + 1, t.num_kv_heads, t.head_dim, generator=gen),
        boundary=torch.randn(L, t.hidden_size, generator=gen),
        rejected=torch.randn(cfg.block_size - m, L, t.hidden_size, generator=gen),
        tokens=torch.tensor(ids),
    )


TEMPERATURES = (0.0, 0.9, 0.0, 1.3)
LENGTHS = (12, 5, 30, 9)


def drive(d: Drafter, rounds: int = 4, greedy: bool = False, split: bool = False) -> list:
    """Prefill four sequences, then ``rounds`` of propose + forced verification; the
    proposals. Even sequences' anchors continue their prompt's period (sure copies), odd
    ones do not. ``split``: updates go apart from the requests (``apply_updates``) every
    other round, as the engine passes a plain round's updates."""
    gen = torch.Generator().manual_seed(7)
    temps = [0.0] * 4 if greedy else list(TEMPERATURES)
    d.prefill([views(d.cfg, i, n, gen) for i, n in enumerate(LENGTHS)])
    pos = list(LENGTHS)
    anchors = [(3 * i + n) % PERIOD if i % 2 == 0 else 40 + i for i, n in enumerate(LENGTHS)]
    ups: list = [None] * 4
    out = []
    for rnd in range(rounds):
        if split and rnd % 2:
            d.apply_updates([u for u in ups if u is not None])
            ups = [None] * 4
        p = d.propose([DraftRequest(i, anchors[i], pos[i], temps[i], ups[i]) for i in range(4)], K)
        out.append(p)
        for i in range(4):
            m = (rnd + i) % (K + 1)
            ids = [anchors[i], *p.tokens[i, :m].tolist()]
            ups[i] = update(d.cfg, i, pos[i], ids, gen)
            pos[i] += m + 1
            anchors[i] = int(p.tokens[i, m]) if m < K else (anchors[i] + 1) % 97
    return out


CONFIGS = {
    "carry": {},
    "copy": {"context_copy": True},
    "copy-input": {"context_copy": True, "copy_input": True, "boundary_input": True},
    "no-carry, reduced vocab": {"carry": False, "draft_vocab_size": 40},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
def test_round_path_names_the_device_of_every_tensor(target_dir, overrides, dtype):
    d = drafter(target_dir, **overrides).cast(dtype)
    for greedy in (True, False):
        with unplaced_factories() as sites:
            proposals = drive(d, greedy=greedy, split=True)
            d.free(list(range(4)))
        assert not sites, f"tensors made without a device: {sorted(sites)}"
    assert proposals[-1].tokens.shape == (4, K)
    if overrides.get("context_copy"):
        assert d.num_copied > 0  # the copy paths ran too


def test_baseline_round_path_names_the_device_of_every_tensor(target_dir):
    base = FullPrefixDrafter.sharing(drafter(target_dir))
    cfg = base.cfg
    L, dd = cfg.num_layers, cfg.target.hidden_size
    gen = torch.Generator().manual_seed(3)
    lengths = (4, 17, 40)
    with unplaced_factories() as sites:
        base.prefill(
            [
                FullPrefixViews(i, t, torch.randn(t, L, dd, generator=gen), seed=i)
                for i, t in enumerate(lengths)
            ]
        )
        for rnd in range(3):
            requests = [
                DraftRequest(
                    i,
                    3 + i,
                    t + 2 * (rnd + 1),
                    0.6 * i,
                    FullPrefixUpdate(
                        i,
                        t + 2 * (rnd + 1),
                        torch.randn(2, L, dd, generator=gen),
                        torch.randn(K - 1, L, dd, generator=gen),
                    ),
                )
                for i, t in enumerate(lengths)
            ]
            assert base.propose(requests, K).tokens.shape == (3, K)
    assert not sites, f"tensors made without a device: {sorted(sites)}"


def same(a: Proposal, b: Proposal) -> bool:
    return all(torch.equal(x, y) for x, y in zip(vars(a).values(), vars(b).values(), strict=True))


@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
def test_a_cpu_drafter_drafts_what_the_default_drafter_drafts(target_dir, overrides):
    """``device="cpu"`` (given, or by ``to``) is the drafter as it was: the same weights,
    samplers and proposals, bit for bit, and nothing anywhere else."""
    default = Drafter.random(
        target_dir,
        DrafterConfig.for_target(
            ModelConfig.from_pretrained(target_dir), window=W, block_size=K, **overrides
        ),
        seed=0,
        init_std=0.2,
    )
    placed = drafter(target_dir, "cpu", **overrides)
    moved = drafter(target_dir, **overrides).to(torch.device("cpu"))
    for d in (placed, moved):
        assert d.device == torch.device("cpu")
        assert {t.device.type for t in [*d.net.parameters(), *d.net.buffers()]} == {"cpu"}
    runs = [drive(d, rounds=5) for d in (default, placed, moved)]
    for ref, got_placed, got_moved in zip(*runs, strict=True):
        assert same(ref, got_placed) and same(ref, got_moved)
    assert {s.generator.device.type for s in placed.states.values()} == {"cpu"}


def test_the_worker_drafts_on_its_spec_device_and_answers_in_host_memory(target_dir):
    spec = DrafterSpec(
        str(target_dir),
        "random",
        k=K,
        dtype="float32",
        device="cpu",
        init_std=0.2,
        overrides={"window": W},
    )
    worker = DrafterWorker(spec)
    assert worker.drafter.device == torch.device("cpu")
    assert worker.summary_queries().device.type == "cpu"
    ref = drafter(target_dir)  # what the worker builds: the same seed, sizes and weights
    gen = torch.Generator().manual_seed(1)
    v = views(ref.cfg, 1, 9, gen)
    worker.prefill([v])
    ref.prefill([v])
    request = DraftRequest(1, 4, 9, 0.7)
    got = worker.propose([request], K)
    assert got.tokens.device.type == "cpu" and same(got, ref.propose([request], K))


def test_host_messages_are_taken_as_they_are(target_dir):
    """Views and updates built on the host feed a CPU drafter without copies of the
    updates (``to`` of a message already there is the message itself), and the token ids
    land in the host history."""
    d = drafter(target_dir, context_copy=True)
    gen = torch.Generator().manual_seed(2)
    v = views(d.cfg, 0, 12, gen)
    assert v.to("cpu") is v and v.nbytes > 0
    d.prefill([v])
    state = d.state(0)
    assert state.history.device.type == "cpu" and state.context_k.device.type == "cpu"
    assert state.recent_tokens().tolist() == v.tokens.tolist()
    u = update(d.cfg, 0, 12, [1, 2, 3], gen)
    assert u.to(d.device) is u
    d.propose([DraftRequest(0, 4, 15, 0.0, u)], K)
    assert state.length == 15 and state.recent_tokens().tolist()[-3:] == [1, 2, 3]
    # a view is copied into the state: the message stays the caller's
    before = v.window_k.clone()
    d.propose([DraftRequest(0, 4, 15, 0.0)], K)
    assert torch.equal(v.window_k, before)


def test_moving_and_casting_keep_a_tied_embedding_one_tensor(target_dir):
    d = drafter(target_dir)
    net = d.net
    net.lm_head = net.embed  # as a tied full-vocabulary head is installed
    d.to("cpu")
    assert net.lm_head is net.embed
    d.cast(torch.float16)  # the whole-network cast (not the host bf16 GEMM form)
    assert net.lm_head is net.embed and net.embed.dtype == torch.float16
    assert net.rope.cos.device.type == "cpu"


def test_auto_dtype_on_a_gpu_is_bfloat16_without_timing(target_dir, monkeypatch):
    import target_actor.weight_choice as weight_choice

    def no_timing(*args, **kwargs):
        raise AssertionError("the CPU timing ran for a GPU drafter")

    monkeypatch.setattr(weight_choice, "choose", no_timing)
    cfg = drafter(target_dir).cfg
    assert drafter_dtype("auto", cfg, "cuda") == torch.bfloat16
    assert drafter_dtype("auto", cfg, torch.device("cuda", 1)) == torch.bfloat16


def test_a_gpu_device_without_a_gpu_is_refused():
    with pytest.raises(DrafterConfigError, match="unknown device"):
        drafter_device("gpu0")
    with pytest.raises(DrafterConfigError, match="num_gpus > 0"):
        RayDrafter("unused", "random", num_gpus=0.0, device="cuda")
    if not torch.cuda.is_available():
        with pytest.raises(DrafterConfigError, match="CUDA is not available"):
            drafter_device("cuda")


def test_proposals_stay_on_the_drafter_device_in_process(target_dir):
    d = drafter(target_dir, context_copy=True)
    p = drive(d, rounds=1)[0]
    assert {t.device for t in vars(p).values()} == {d.device}
    assert p.to(d.device) is p  # nothing to move: no copy


def test_messages_keep_token_ids_on_the_host_and_proposals_move_whole():
    """``to`` moves every tensor of a message but a view's or an update's token ids; a
    proposal's ``tokens`` are draft ids and move with it."""
    from target_actor.messages import Proposal, RoundUpdate

    e = torch.zeros(2, 1, 1, 4)
    u = RoundUpdate(0, 3, e, e, torch.zeros(2, 4), torch.zeros(0, 2, 4), torch.arange(1))
    moved = u.to("meta")
    assert moved.committed_k.device.type == "meta" and moved.tokens.device.type == "cpu"
    p = Proposal(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, 1, dtype=torch.long),
                 torch.ones(1, 2, 1))  # fmt: skip
    assert p.to("meta").tokens.device.type == "meta"
