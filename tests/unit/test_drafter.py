"""The LongSpark drafter on a tiny random target: real taps, simulated verification rounds."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from drafter_actor.baseline import FullPrefixDrafter, FullPrefixUpdate, FullPrefixViews
from drafter_actor.config import DrafterConfig, DrafterConfigError
from drafter_actor.drafter import Drafter
from drafter_actor.state import DrafterStateError, SequenceState
from drafter_actor.worker import DrafterSpec, DrafterWorker, LocalDrafter
from target_actor.batch import ForwardBatch
from target_actor.messages import HISTORY_TOKENS, DraftRequest, PrefillViews, RoundUpdate
from target_actor.runner import TargetRunner, TargetSpec
from target_actor.summary import build_prefill_views, build_round_update
from tests.conftest import make_tiny_checkpoint

K, W = 5, 8


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A tiny llama with 8 layers, so that 4 layers are tapped."""
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny8") / "llama", "llama", num_hidden_layers=8
    )


@pytest.fixture(scope="module")
def runner(target_dir):
    return TargetRunner(TargetSpec(str(target_dir)))


def make_drafter(target_dir, runner, cls=Drafter, **overrides) -> Drafter:
    cfg = DrafterConfig.for_target(runner.cfg, window=W, block_size=K, **overrides)
    return cls.random(target_dir, cfg, seed=0, init_std=0.2)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Episode:
    """One sequence driven through prefill and forced verification rounds on the real target."""

    def __init__(
        self, runner: TargetRunner, seq_id: int, prompt: list[int], temperature=0.0, seed=None
    ):
        self.runner, self.seq_id, self.temperature, self.seed = runner, seq_id, temperature, seed
        self.committed = list(prompt)
        out = runner.forward(ForwardBatch.single(seq_id, prompt, 0, num_logits=1, taps=True))
        self.prefill_taps = out
        self.anchor = int(out.logits[-1].argmax())
        self.update: RoundUpdate | None = None

    def views(self, g: torch.Tensor, window: int = W) -> PrefillViews:
        o = self.prefill_taps
        return build_prefill_views(
            self.seq_id, o.tap_k, o.tap_v, o.tap_hidden, g, window, seed=self.seed
        )

    @property
    def position(self) -> int:
        return len(self.committed)

    def request(self) -> DraftRequest:
        return DraftRequest(self.seq_id, self.anchor, self.position, self.temperature, self.update)

    def verify(self, drafts: list[int], accepted: int) -> RoundUpdate:
        """Run the target over ``[anchor, drafts]``, accept ``accepted`` drafts (forced)."""
        t, block = self.position, [self.anchor, *drafts]
        out = self.runner.forward(
            ForwardBatch.single(self.seq_id, block, t, num_logits=len(block), taps=True)
        )
        self.update = build_round_update(
            self.seq_id, t, accepted, out.tap_k, out.tap_v, out.tap_hidden
        )
        self.committed += block[: accepted + 1]
        self.anchor = int(out.logits[accepted].argmax())
        return self.update


def test_drafts_and_proposals_are_well_formed(target_dir, runner):
    drafter = make_drafter(target_dir, runner)
    greedy, sampled = (
        Episode(runner, 0, tokens(11, 0)),
        Episode(runner, 1, tokens(6, 1), 0.9, seed=3),
    )
    drafter.prefill(
        [greedy.views(drafter.summary_queries()), sampled.views(drafter.summary_queries())]
    )
    prop = drafter.propose([greedy.request(), sampled.request()], K)
    assert prop.tokens.shape == (2, K) and prop.tokens.dtype == torch.int64
    assert (
        prop.q_ids.shape == prop.q_probs.shape == (2, K, 8) and prop.q_probs.dtype == torch.float32
    )
    assert torch.allclose(prop.q_probs.sum(-1), torch.ones(2, K), atol=1e-5)
    in_support = prop.q_ids == prop.tokens.unsqueeze(-1)
    assert (in_support.sum(-1) == 1).all()  # support ids are distinct and hold the draft
    assert (prop.q_probs[in_support] > 0).all()
    one_hot = torch.zeros(K, 8)
    one_hot[:, 0] = 1
    assert torch.equal(prop.q_probs[0], one_hot) and torch.equal(
        prop.q_ids[0, :, 0], prop.tokens[0]
    )
    assert len(set(prop.tokens[0].tolist())) > 1  # the drafts vary across slots
    runner.free([0, 1])


def test_incremental_views_equal_views_rebuilt_from_scratch(target_dir, runner):
    drafter = make_drafter(target_dir, runner)
    ep = Episode(runner, 0, tokens(6, 2))
    drafter.prefill([ep.views(drafter.summary_queries())])
    for accepted in (1, K, 0, 3, 2):  # crosses W = 8 committed rows on the way
        drafts = drafter.propose([ep.request()], K).tokens[0].tolist()
        ep.verify(drafts, accepted)
    drafter.propose([ep.request()], K)  # applies the last update
    state = drafter.state(0)
    t = ep.position
    assert state.length == t == 6 + 2 + 6 + 1 + 4 + 3
    fresh = runner.forward(ForwardBatch.single(9, ep.committed, 0, taps=True))
    ref = build_prefill_views(
        9, fresh.tap_k, fresh.tap_v, fresh.tap_hidden, drafter.summary_queries(), W
    )
    assert (state.summary_m - ref.summary_m).abs().max() <= 1e-5
    assert (state.summary_lam - ref.summary_lam).abs().max() <= 1e-5
    slots = torch.arange(t - W, t) % W
    assert (state.window_k[:, :, slots] - ref.window_k.transpose(1, 2)).abs().max() <= 1e-5
    assert (state.window_v[:, :, slots] - ref.window_v.transpose(1, 2)).abs().max() <= 1e-5
    assert (state.boundary - ref.boundary).abs().max() <= 1e-5
    runner.free([0, 9])


def test_carry_rows_are_replaced_each_round_and_empty_after_full_acceptance(target_dir, runner):
    drafter = make_drafter(target_dir, runner)
    ep = Episode(runner, 0, tokens(9, 3))
    drafter.prefill([ep.views(drafter.summary_queries())])
    for accepted in (1, 3, K, 0):
        drafts = drafter.propose([ep.request()], K).tokens[0].tolist()
        update = ep.verify(drafts, accepted)
        drafter.propose([ep.request()], K)
        state = drafter.state(0)
        assert state.carry_len == K - accepted
        assert torch.equal(state.carry[: K - accepted], update.rejected)
        # the rejected positions t+m+1..t+k, i.e. starting at the new anchor's position
        assert state.carry_positions().tolist() == list(
            range(update.length, update.length + K - accepted)
        )
        ctx = drafter._contexts([state])[0]
        assert (
            ctx.mask[0].tolist()
            == [True] * W + [True] + [True] * (K - accepted) + [False] * accepted
        )
        ep.update = None  # already applied
    runner.free([0])


def _layer_kv(ctx, state, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``i``'s context keys and values ``[1, H_kv, C, hd]``: stacked (torch's path) or
    where the C attention reads them (the state's own buffers)."""
    if ctx.refs is None:
        return ctx.k, ctx.v
    return state.context_k[i][None], state.context_v[i][None]


def test_carry_rows_are_projected_at_their_absolute_positions(target_dir, runner):
    drafter = make_drafter(target_dir, runner)
    ep = Episode(runner, 0, tokens(12, 4))
    drafter.prefill([ep.views(drafter.summary_queries())])
    ep.verify(drafter.propose([ep.request()], K).tokens[0].tolist(), 1)
    drafter.propose([ep.request()], K)
    state, net = drafter.state(0), drafter.net
    ctx = drafter._contexts([state])
    feats = net.carry_features(state.carry[: K - 1]).unsqueeze(0)
    expect = net.project_context(feats, state.carry_positions().unsqueeze(0))
    for i, (k, v) in enumerate(expect):
        got_k, got_v = _layer_kv(ctx[i], state, i)
        assert torch.allclose(got_k[:, :, W + 1 : W + K], k, atol=1e-6)
        assert torch.allclose(got_v[:, :, W + 1 : W + K], v, atol=1e-6)
    boundary = net.project_context(
        net.fuse(state.boundary)[None, None], torch.tensor([[ep.position - 1]])
    )
    assert torch.allclose(
        _layer_kv(ctx[0], state, 0)[0][:, :, W : W + 1], boundary[0][0], atol=1e-6
    )
    runner.free([0])


def test_carry_disabled_keeps_no_carry_rows_and_empty_carry_changes_nothing(target_dir, runner):
    on = make_drafter(target_dir, runner)
    off = make_drafter(target_dir, runner, carry=False)
    ep = Episode(runner, 0, tokens(10, 5))
    for d in (on, off):
        d.prefill([ep.views(d.summary_queries())])
    first_on, first_off = on.propose([ep.request()], K), off.propose([ep.request()], K)
    # no carry yet: masked carry rows contribute exactly nothing
    assert torch.equal(first_on.tokens, first_off.tokens)
    assert torch.allclose(first_on.q_probs, first_off.q_probs, atol=1e-6)
    ep.verify(first_on.tokens[0].tolist(), 1)
    second_on, second_off = on.propose([ep.request()], K), off.propose([ep.request()], K)
    assert off.state(0).carry_len == 0 and on.state(0).carry_len == K - 1
    for d, rows in ((off, W + 1), (on, W + 1 + K)):
        ctx = d._contexts([d.state(0)])[0]
        assert ctx.mask.shape[1] == rows and _layer_kv(ctx, d.state(0), 0)[0].shape[2] == rows
    assert not torch.equal(second_on.q_ids, second_off.q_ids) or not torch.equal(
        second_on.tokens, second_off.tokens
    )
    runner.free([0])


def test_batch_drafts_what_each_sequence_drafts_alone(target_dir, runner):
    specs = [(3, 0.0, None), (8, 0.0, None), (13, 0.8, 5), (30, 1.0, 6), (1, 0.5, 7)]
    batched = make_drafter(target_dir, runner)
    alone = [make_drafter(target_dir, runner) for _ in specs]
    eps = [
        Episode(runner, i, tokens(n, 10 + i), temp, seed) for i, (n, temp, seed) in enumerate(specs)
    ]
    g = batched.summary_queries()
    batched.prefill([ep.views(g) for ep in eps])
    for d, ep in zip(alone, eps, strict=True):
        d.prefill([ep.views(g)])
    for rnd, accepted in enumerate([(0, 2, K, 1, 3), (4, 0, 1, K, 2), (1, 1, 1, 0, 0)]):
        requests = [ep.request() for ep in eps]
        together = batched.propose(requests, K)
        for i, (d, r) in enumerate(zip(alone, requests, strict=True)):
            single = d.propose([r], K)
            assert torch.equal(single.tokens[0], together.tokens[i]), (rnd, i)
            assert torch.equal(single.q_ids[0], together.q_ids[i]), (rnd, i)
            assert torch.allclose(single.q_probs[0], together.q_probs[i], atol=1e-6), (rnd, i)
        for ep, toks, m in zip(eps, together.tokens.tolist(), accepted, strict=True):
            ep.verify(toks, m)
    runner.free(list(range(len(specs))))


def test_seeded_sampling_repeats_and_differs_by_seed(target_dir, runner):
    ep = Episode(runner, 0, tokens(12, 20), temperature=1.5, seed=42)
    runs = []
    for seed in (42, 42, 43):
        d = make_drafter(target_dir, runner)
        views = dataclasses.replace(ep.views(d.summary_queries()), seed=seed)
        d.prefill([views])
        runs.append(torch.cat([d.propose([ep.request()], K).tokens for _ in range(3)]))
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])
    runner.free([0])


def test_reduced_draft_vocabulary_maps_back_to_target_ids(target_dir, runner):
    drafter = make_drafter(target_dir, runner, draft_vocab_size=40)
    assert torch.equal(drafter.net.d2t, torch.arange(40))
    ep = Episode(runner, 0, tokens(7, 21), temperature=1.0, seed=1)
    ep.anchor = 90  # outside the draft vocabulary: the Markov head's extra row
    drafter.prefill([ep.views(drafter.summary_queries())])
    prop = drafter.propose([ep.request()], K)
    assert (prop.tokens < 40).all() and (prop.q_ids < 40).all()
    assert torch.allclose(prop.q_probs.sum(-1), torch.ones(1, K), atol=1e-5)
    runner.free([0])


def random_views(cfg: DrafterConfig, seq_id: int, length: int) -> PrefillViews:
    t, L, w = cfg.target, cfg.num_layers, min(cfg.window, length)
    return PrefillViews(
        seq_id=seq_id,
        length=length,
        window_k=torch.randn(L, w, t.num_kv_heads, t.head_dim),
        window_v=torch.randn(L, w, t.num_kv_heads, t.head_dim),
        summary_m=torch.randn(L, t.num_heads, cfg.summary_slots, t.head_dim),
        summary_lam=torch.randn(L, t.num_heads, cfg.summary_slots),
        boundary=torch.randn(L, t.hidden_size),
    )


def random_update(cfg: DrafterConfig, seq_id: int, length: int, accepted: int) -> RoundUpdate:
    t, L = cfg.target, cfg.num_layers
    return RoundUpdate(
        seq_id=seq_id,
        length=length + accepted + 1,
        committed_k=torch.randn(L, accepted + 1, t.num_kv_heads, t.head_dim),
        committed_v=torch.randn(L, accepted + 1, t.num_kv_heads, t.head_dim),
        boundary=torch.randn(L, t.hidden_size),
        rejected=torch.randn(cfg.block_size - accepted, L, t.hidden_size),
    )


def test_state_bytes_are_the_same_at_1k_and_32k(target_dir):
    drafter = Drafter.random(target_dir, seed=0)  # default sizes: W=256, R=16, k=15
    cfg = drafter.cfg
    sizes = []
    for seq_id, t in ((0, 1024), (1, 32768)):
        drafter.prefill([random_views(cfg, seq_id, t)])
        sizes.append(drafter.state_bytes(seq_id))
        update = random_update(cfg, seq_id, t, 2)
        drafter.propose([DraftRequest(seq_id, 1, update.length, 0.0, update)], cfg.block_size)
        assert drafter.state_bytes(seq_id) == sizes[-1]
    expected = SequenceState.expected_bytes(cfg)
    t, L = cfg.target, cfg.num_layers
    assert (
        expected
        == 4
        * (
            2 * L * (256 + 1 + 15 * cfg.carry) * t.num_kv_heads * t.head_dim  # + round rows
            + L * t.num_heads * 16 * (t.head_dim + 1)
            + 16 * L * t.hidden_size
        )
        + 8 * HISTORY_TOKENS
    )  # the token history of context copy, int64
    assert sizes == [expected, expected]


def test_requests_that_do_not_fit_the_state_are_refused(target_dir, runner):
    drafter = make_drafter(target_dir, runner)
    cfg = drafter.cfg
    drafter.prefill([random_views(cfg, 0, 20)])
    with pytest.raises(DrafterStateError, match="unknown sequence 5"):
        drafter.propose([DraftRequest(5, 1, 20)], K)
    with pytest.raises(DrafterStateError, match="position 21"):
        drafter.propose([DraftRequest(0, 1, 21)], K)
    with pytest.raises(DrafterStateError, match="k=6"):
        drafter.propose([DraftRequest(0, 1, 20)], K + 1)
    with pytest.raises(DrafterStateError, match="does not follow"):
        drafter.propose([DraftRequest(0, 1, 23, 0.0, random_update(cfg, 0, 19, 3))], K)
    drafter.free([0, 1])
    assert drafter.num_states() == 0


def test_full_prefix_baseline_drafts_and_its_state_grows(target_dir, runner):
    longspark = make_drafter(target_dir, runner)
    base = FullPrefixDrafter.sharing(longspark)
    cfg = base.cfg
    L, d = cfg.num_layers, cfg.target.hidden_size
    for seq_id, t in ((0, 30), (1, 300)):
        base.prefill([FullPrefixViews(seq_id, t, torch.randn(t, L, d), seed=seq_id)])
    assert base.state_bytes(1) > 5 * base.state_bytes(0)
    update = FullPrefixUpdate(0, 33, torch.randn(3, L, d), torch.randn(K - 2, L, d))
    requests = [DraftRequest(0, 4, 33, 0.0, update), DraftRequest(1, 5, 300, 0.7)]
    together = base.propose(requests, K)
    assert together.tokens.shape == (2, K) and base.state(0).length == 33
    assert torch.allclose(together.q_probs.sum(-1), torch.ones(2, K), atol=1e-5)


def test_full_prefix_batch_equals_alone(target_dir, runner):
    net_owner = make_drafter(target_dir, runner)
    batched = FullPrefixDrafter.sharing(net_owner)
    alone = [FullPrefixDrafter.sharing(net_owner) for _ in range(3)]
    cfg = batched.cfg
    L, d = cfg.num_layers, cfg.target.hidden_size
    gen = torch.Generator().manual_seed(0)
    lengths = (4, 17, 40)
    views = [
        FullPrefixViews(i, t, torch.randn(t, L, d, generator=gen), seed=i)
        for i, t in enumerate(lengths)
    ]
    batched.prefill(views)
    for a, v in zip(alone, views, strict=True):
        a.prefill([v])
    updates = [
        FullPrefixUpdate(
            i, t + 2, torch.randn(2, L, d, generator=gen), torch.randn(K - 1, L, d, generator=gen)
        )
        for i, t in enumerate(lengths)
    ]
    requests = [DraftRequest(i, 3 + i, t + 2, 0.6 * i, updates[i]) for i, t in enumerate(lengths)]
    together = batched.propose(requests, K)
    for i, (a, r) in enumerate(zip(alone, requests, strict=True)):
        single = a.propose([r], K)
        assert torch.equal(single.tokens[0], together.tokens[i])
        assert torch.allclose(single.q_probs[0], together.q_probs[i], atol=1e-6)


def test_local_drafter_takes_updates_from_the_verify_round(target_dir, runner, tmp_path):
    threads = torch.get_num_threads()
    drafter = LocalDrafter(str(target_dir), "random", k=4, carry=False, seed=1, num_threads=1)
    try:
        assert drafter.k == 4 and drafter.window == 256 and drafter.cfg.carry is False
        ep = Episode(runner, 0, tokens(9, 30))
        drafter.prefill([ep.views(drafter.summary_queries(), window=256)])
        prop = drafter.propose([ep.request()], 4)
        assert prop.tokens.shape == (1, 4) and drafter.num_states() == 1
        update = ep.verify(prop.tokens[0].tolist(), 2)
        ep.update = None  # comes separately, as the engine passes the target's handle
        gone = dataclasses.replace(update, seq_id=77)  # a sequence freed since: dropped
        drafter.propose([ep.request()], 3, [update, gone])
        assert drafter.worker.drafter.state(0).length == ep.position
        drafter.free([0])
        assert drafter.num_states() == 0
        drafter.worker.drafter.save_pretrained(tmp_path / "d")
        with pytest.raises(DrafterConfigError, match="k=5 outside 1..4"):
            DrafterWorker(DrafterSpec(str(target_dir), str(tmp_path / "d"), k=5))
    finally:
        torch.set_num_threads(threads)
        runner.free([0])


def test_history_follows_prefill_and_rounds(target_dir):
    drafter = Drafter.random(target_dir, seed=0)
    views = random_views(drafter.cfg, 0, 10)
    views.tokens = torch.arange(10)
    drafter.prefill([views])
    state = drafter.state(0)
    assert state.recent_tokens().tolist() == list(range(10))
    update = random_update(drafter.cfg, 0, 10, 2)  # 3 committed rows: positions 10..12
    update.tokens = torch.tensor([50, 51, 52])
    drafter.propose([DraftRequest(0, 7, 13, 0.0, update)], 4)
    assert state.recent_tokens().tolist() == [*range(10), 50, 51, 52]
    assert state.history.shape == (HISTORY_TOKENS,)
    # an update without ids restarts the history (it can no longer be trusted)
    update = random_update(drafter.cfg, 0, 13, 0)
    drafter.propose([DraftRequest(0, 7, 14, 0.0, update)], 4)
    assert state.recent_tokens().tolist() == []


def test_history_keeps_the_last_tokens(target_dir):
    drafter = Drafter.random(target_dir, seed=0)
    views = random_views(drafter.cfg, 0, 300)
    views.tokens = torch.arange(HISTORY_TOKENS + 300)
    drafter.prefill([views])
    recent = drafter.state(0).recent_tokens()
    assert recent.tolist() == list(range(300, HISTORY_TOKENS + 300))
