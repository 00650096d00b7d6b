"""Offline greedy acceptance of a trained drafter on held-out recorded sequences.

At anchors of each held-out response (every position by default) the drafter drafts
greedily from the views of the recorded prefix (teacher-forced anchors, no carry), and a
draft is accepted up to its first mismatch with the recorded continuation, which is the
target's own greedy output. Two numbers, both with the bonus token included:

- ``tau``: ``1 + mean accepted`` over the anchors, every position counting once;
- ``tau_rounds``: what the engine measures. Greedy decoding walks each response in rounds
  (anchor ``a`` accepts ``m`` drafts, the next round's anchor is ``a + m + 1``), and tau is
  tokens over rounds. Hard stretches take a round per token and easy ones a round per
  ``k + 1``, so ``tau_rounds`` is lower than ``tau``, and it is the one the engine's
  ``eval acceptance`` reproduces (v9, network alone, the 48 benchmark answers: 2.244 here,
  2.243 through the engine).

Cheap: no target forward when the taps are cached. The engine benchmark, with real
verification rounds, context copy and carryover, is separate.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from drafter_actor.config import DrafterConfigError
from drafter_actor.drafter import Drafter
from drafter_actor.training.carryover import greedy_drafts
from drafter_actor.training.config import MAX_K, TrainError
from drafter_actor.training.data import Sequence, read_sequences, split_holdout
from drafter_actor.training.tap_cache import TapCache
from drafter_actor.training.target_pass import TargetPass
from drafter_actor.training.trainer import HOLDOUT, TRAIN_CONFIG, resolve_target_path
from drafter_actor.training.views import (
    Anchors,
    Batch,
    block_labels,
    block_logits,
    build_views,
    sample_anchors,
)
from target_actor.config import ModelConfig


@torch.no_grad()
def evaluate_tau(
    drafter_dir: str | Path,
    data_dir: str | Path,
    num_seqs: int = 32,
    k: int | None = None,
    target: str | None = None,
    cache_dir: str | Path | None = None,
    anchors_per_seq: int = 0,
    seqs_per_batch: int = 2,
    seed: int = 0,
) -> dict[str, Any]:
    """Offline greedy acceptance length of the drafter in ``drafter_dir``.

    Sequences: the run's held-out ids (``holdout_ids.json``) if the folder has them, else
    the ``num_seqs`` records the training split would hold out. Taps come from the run's
    cache when it has them, else from the target (not stored). ``anchors_per_seq``: random
    anchors per response (0: every position, and ``tau_rounds`` is computed). Returns
    ``tau``, ``tau_rounds`` (``None`` with random anchors), ``accepted_at_least`` (fraction
    of anchors with >= i accepted drafts, i = 1..k), ``num_anchors``, ``num_seqs``, ``k``.
    """
    drafter_dir = Path(drafter_dir)
    info_path = drafter_dir / TRAIN_CONFIG
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    target_path = resolve_target_path(target or info.get("target_path") or info.get("target"))
    try:
        net = Drafter.from_pretrained(drafter_dir, target_path).net
    except DrafterConfigError as e:
        raise TrainError(str(e)) from None
    k = k or net.cfg.block_size
    if not 1 <= k <= MAX_K:
        raise TrainError(f"k={k} outside 1..{MAX_K}")

    max_len = int(info.get("max_len", 768))
    eos_ids = ModelConfig.from_pretrained(target_path).eos_token_ids
    seqs = read_sequences(str(data_dir), net.cfg.target.vocab_size, max_len, eos_ids)
    seqs = [s for s in seqs if not s.target_labels]  # acceptance is exact on the target's text
    held_path = drafter_dir / HOLDOUT
    held = json.loads(held_path.read_text()) if held_path.is_file() else None
    if held is None:
        held = split_holdout([s.id for s in seqs], num_seqs)[1]
    by_id = {s.id: s for s in seqs}
    chosen = [by_id[i] for i in held if i in by_id][:num_seqs]
    if not chosen:
        raise TrainError(f"{data_dir}: none of the held-out sequences is there")

    taps = _Taps(target_path, net.cfg.tap_layer_ids, cache_dir or info.get("cache_dir"))
    gen = torch.Generator().manual_seed(seed)
    every = anchors_per_seq == 0
    accepted_all, rounds, walked = [], 0, 0
    for start in range(0, len(chosen), seqs_per_batch):
        group = chosen[start : start + seqs_per_batch]
        batch = Batch.collate([taps.get(s) for s in group])
        anchors = Anchors.pad(
            [
                torch.arange(s.prompt_len, len(s.tokens) - 1)
                if every
                else sample_anchors(len(s.tokens), s.prompt_len, anchors_per_seq, gen)
                for s in group
            ]
        )
        views = build_views(net, batch, anchors)
        base = block_logits(net, views, batch, k)
        drafts = greedy_drafts(net, base, batch.tokens[views.seq, views.pos])
        labels, valid = block_labels(batch, views, k)
        leading = ((drafts == labels) & valid).long().cumprod(1).sum(1)  # [N]
        accepted_all.append(leading[valid.all(1)])
        if every:
            for b in range(len(group)):
                r, m = _walk(leading[views.seq == b].tolist())
                rounds, walked = rounds + r, walked + m
    accepted = torch.cat(accepted_all)
    if accepted.numel() == 0:
        raise TrainError("no held-out anchor has k labels: use a smaller k")
    return {
        "tau": 1.0 + float(accepted.float().mean()),
        "tau_rounds": 1.0 + walked / rounds if every and rounds else None,
        "accepted_at_least": [float((accepted >= i).float().mean()) for i in range(1, k + 1)],
        "num_anchors": int(accepted.numel()),
        "num_seqs": len(chosen),
        "k": k,
    }


def _walk(accepted: list[int]) -> tuple[int, int]:
    """``(rounds, accepted drafts)`` of greedy decoding through one response, given the
    drafts accepted at each of its anchors (in position order, one per position)."""
    rounds = total = i = 0
    while i < len(accepted):
        rounds, total = rounds + 1, total + accepted[i]
        i += accepted[i] + 1
    return rounds, total


class _Taps:
    """Cached taps where the cache has the sequence, else the target's (computed lazily)."""

    def __init__(self, target_path: Path, tap_ids: tuple[int, ...], cache_dir: str | None) -> None:
        self.target_path, self.tap_ids = target_path, tap_ids
        self.cache: TapCache | None = None
        self._target: TargetPass | None = None
        if cache_dir and (Path(cache_dir) / "index.json").is_file():
            cache = TapCache(cache_dir)
            if list(cache.meta.get("tap_layer_ids", [])) == list(tap_ids):
                self.cache = cache

    def get(self, s: Sequence):
        if self.cache is not None and self.cache.matches(s):
            return self.cache.get(s.id)
        if self._target is None:
            from target_actor.runner import TargetRunner, TargetSpec

            spec = TargetSpec(str(self.target_path), kv_cache_tokens=16, tap_layer_ids=self.tap_ids)
            self._target = TargetPass(TargetRunner(spec).model)
        h, kk, vv = self._target.taps([s.tokens])[0]
        return torch.tensor(s.tokens), h, kk, vv
