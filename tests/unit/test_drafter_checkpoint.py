"""Drafter checkpoints: bit-exact round trip, drafter-owned weights only, clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from drafter_actor.config import DrafterConfig, DrafterConfigError
from drafter_actor.drafter import Drafter
from target_actor.config import ModelConfig
from target_actor.messages import DraftRequest, PrefillViews
from tests.conftest import make_tiny_checkpoint
from tests.unit.test_drafter_device import random_views


def views(cfg: DrafterConfig, seq_id: int, length: int, seed: int) -> PrefillViews:
    return random_views(cfg, seq_id, length, torch.Generator().manual_seed(seed), seed)


def drafts(drafter: Drafter) -> tuple[torch.Tensor, torch.Tensor]:
    drafter.prefill([views(drafter.cfg, 0, 40, 1), views(drafter.cfg, 1, 7, 2)])
    requests = [DraftRequest(0, 3, 40, 0.0), DraftRequest(1, 60, 7, 1.0)]
    prop = drafter.propose(requests, 6)
    return prop.tokens, prop.q_probs


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_save_load_round_trips_bit_exactly(tiny_checkpoints, tmp_path, arch):
    target = tiny_checkpoints[arch]
    cfg = DrafterConfig.for_target(ModelConfig.from_pretrained(target), window=16, block_size=6)
    drafter = Drafter.random(target, cfg, seed=3, init_std=0.2)
    drafter.save_pretrained(tmp_path / "d")
    loaded = Drafter.from_pretrained(tmp_path / "d", target)
    assert loaded.cfg == drafter.cfg
    ours, theirs = drafter.net.state_dict(), loaded.net.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)
    assert torch.equal(drafter.net.embed, loaded.net.embed)
    assert torch.equal(drafter.net.lm_head, loaded.net.lm_head)
    a, b = drafts(drafter), drafts(loaded)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_checkpoint_holds_config_and_drafter_owned_weights_only(tiny_checkpoints, tmp_path):
    target = tiny_checkpoints["llama"]
    drafter = Drafter.random(target, seed=0)
    drafter.save_pretrained(tmp_path / "d")
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert raw["architectures"] == ["LongSparkDrafter"]
    for key in ("tap_layer_ids", "window", "summary_slots", "markov_rank", "block_size"):
        assert key in raw
    for key in ("proposal_support", "carry", "mlp_width", "draft_vocab_size"):
        assert key in raw
    assert raw["target"] == {
        "arch": "llama",
        "hidden_size": 64,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 16,
        "vocab_size": 97,
        "num_layers": 4,
        "rope_theta": 10000.0,
    }
    assert raw["mlp_width"] == 48 and raw["window"] == 256 and raw["summary_slots"] == 16
    with safe_open(tmp_path / "d" / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
    assert "d2t" in names and "summary_queries" in names and "carry_embedding" in names
    assert not any("embed." in n or n.startswith(("embed", "lm_head", "t2d")) for n in names)
    params = sum(p.numel() for p in drafter.net.parameters())
    assert drafter.net.num_parameters() == params


def test_bf16_checkpoint_is_half_the_size_and_loads(tiny_checkpoints, tmp_path):
    target = tiny_checkpoints["llama"]
    drafter = Drafter.random(target, seed=0)
    drafter.save_pretrained(tmp_path / "fp32")
    drafter.save_pretrained(tmp_path / "bf16", dtype="bfloat16")
    fp32 = (tmp_path / "fp32" / "model.safetensors").stat().st_size
    bf16 = (tmp_path / "bf16" / "model.safetensors").stat().st_size
    assert bf16 < 0.55 * fp32
    loaded = Drafter.from_pretrained(tmp_path / "bf16", target)
    w = drafter.net.summary_queries
    assert torch.equal(loaded.net.summary_queries, w.bfloat16().float())


def test_reduced_vocabulary_and_carry_flag_survive_the_round_trip(tiny_checkpoints, tmp_path):
    target = tiny_checkpoints["qwen2"]
    tcfg = ModelConfig.from_pretrained(target)
    cfg = DrafterConfig.for_target(tcfg, draft_vocab_size=30, window=8)
    d2t = torch.sort(torch.randperm(97, generator=torch.Generator().manual_seed(0))[:30]).values
    drafter = Drafter.random(target, cfg, seed=1, d2t=d2t)
    assert not tcfg.tie_word_embeddings
    assert not torch.equal(drafter.net.lm_head, drafter.net.embed[d2t])
    drafter.save_pretrained(tmp_path / "d")
    loaded = Drafter.from_pretrained(tmp_path / "d", target)
    assert torch.equal(loaded.net.d2t, d2t)
    assert torch.equal(loaded.net.lm_head, drafter.net.lm_head)
    tokens, _ = drafts(loaded)
    assert torch.isin(tokens, d2t).all()
    assert Drafter.from_pretrained(tmp_path / "d", target, carry=False).cfg.carry is False


def test_mismatched_target_is_a_clear_one_line_error(tiny_checkpoints, tmp_path):
    Drafter.random(tiny_checkpoints["llama"], seed=0).save_pretrained(tmp_path / "d")
    with pytest.raises(DrafterConfigError) as err:
        Drafter.from_pretrained(tmp_path / "d", tiny_checkpoints["qwen3"])
    assert "\n" not in str(err.value) and "arch llama!=qwen3" in str(err.value)
    assert "head_dim 16!=32" in str(err.value)
    other = make_tiny_checkpoint(tmp_path / "v101", "llama", vocab_size=101)
    with pytest.raises(DrafterConfigError, match="vocab_size 97!=101"):
        Drafter.from_pretrained(tmp_path / "d", other)
    assert issubclass(DrafterConfigError, ValueError)


def test_broken_checkpoints_are_refused_in_one_line(tiny_checkpoints, tmp_path):
    target = tiny_checkpoints["llama"]
    with pytest.raises(DrafterConfigError, match="not a drafter checkpoint"):
        Drafter.from_pretrained(tmp_path, target)
    Drafter.random(target, seed=0).save_pretrained(tmp_path / "d")
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    (tmp_path / "d" / "config.json").write_text(json.dumps({**raw, "summary_slots": 4}))
    with pytest.raises(DrafterConfigError, match="weights do not fit") as err:
        Drafter.from_pretrained(tmp_path / "d", target)
    assert "\n" not in str(err.value)
    cfg = DrafterConfig.for_target(ModelConfig.from_pretrained(target))
    cfg.check_taps(ModelConfig.from_pretrained(target).tap_layer_ids)
    with pytest.raises(DrafterConfigError, match="target taps layers"):
        cfg.check_taps([0, 1])
    with pytest.raises(DrafterConfigError, match="window must be >= 1"):
        DrafterConfig.for_target(ModelConfig.from_pretrained(target), window=0)
