"""``train_drafter``: the baseline stage and the Carryover stage of LongSpark drafter training.

One step takes ``seqs_per_step`` cached sequences and up to ``anchors_per_seq`` random
anchors in each response, builds every anchor's views as inference would (``views``),
runs ONE block pass over all anchors and takes the slot-weighted loss (``objective``).

Carryover (``carryover=True``, from a baseline drafter): a detached greedy first draft at
every anchor, verified by the frozen target in parallel branches (``target_pass``); each
anchor moves to ``a' = a + m + 1`` and the second draft, with the branch's rejected
hidden states as carry rows, learns the recorded continuation from ``a'``. Gradients
flow through the second draft only; fully accepted branches train with empty carry.

The step's data is a pure function of ``(seed, step)``, so checkpoints resume exactly.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from drafter_actor.checkpoint import load_target_head, save_drafter
from drafter_actor.config import DrafterConfig, DrafterConfigError
from drafter_actor.network import DrafterNetwork
from drafter_actor.training.carryover import draft_verify
from drafter_actor.training.checkpoint import (
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    saved_drafter,
    trainer_state,
)
from drafter_actor.training.config import TrainConfig, TrainError
from drafter_actor.training.data import (
    Sequence,
    draft_vocabulary,
    read_sequences,
    repeat_by_folder,
    split_holdout,
)
from drafter_actor.training.grow import grow_weights
from drafter_actor.training.objective import BlockStats, block_loss
from drafter_actor.training.revocab import remap_draft_vocab
from drafter_actor.training.tap_cache import build_tap_cache
from drafter_actor.training.target_pass import TargetPass
from drafter_actor.training.views import (
    Anchors,
    AnchorViews,
    Batch,
    block_labels,
    block_logits,
    build_views,
    sample_anchors,
)
from target_actor.config import ModelConfig, TargetConfigError, default_tap_layer_ids
from target_actor.runner import TargetRunner, TargetSpec

log = logging.getLogger("longspark.train")

TRAIN_CONFIG = "train_config.json"
HOLDOUT = "holdout_ids.json"
LOG_NAME = "train_log.jsonl"


# -- setup ---------------------------------------------------------------------------------


def resolve_target_path(spec: str | None) -> Path:
    from target_actor.checkpoint import ModelFetchError, resolve_target

    try:
        return Path(resolve_target(spec))
    except (ModelFetchError, TargetConfigError, OSError) as e:
        raise TrainError(f"target {spec!r}: {e}") from None


def load_sequences(cfg: TrainConfig, target: ModelConfig) -> list[Sequence]:
    """The data folder's records as training sequences (those with at least one anchor)."""
    seqs = read_sequences(cfg.data_dir, target.vocab_size, cfg.max_len, target.eos_token_ids)
    if cfg.max_seqs:
        seqs = seqs[: cfg.max_seqs]
    if len(seqs) <= cfg.eval_seqs:
        raise TrainError(
            f"{cfg.data_dir}: {len(seqs)} usable sequences, not more than eval_seqs={cfg.eval_seqs}"
        )
    return seqs


class Trainer:
    """Holds the frozen target, the cache, the drafter and its optimizer for one run."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.out = Path(cfg.out)
        self.target_path = resolve_target_path(cfg.target)
        try:
            self.target_cfg = ModelConfig.from_pretrained(self.target_path)
        except (TargetConfigError, OSError) as e:
            raise TrainError(f"target {self.target_path}: {e}") from None
        seqs = load_sequences(cfg, self.target_cfg)
        ckpts = list_checkpoints(self.out)
        if ckpts and not cfg.resume:
            raise TrainError(f"{self.out} already holds checkpoints: resume, or use a new out")
        self.resume_from = ckpts[-1] if cfg.resume and ckpts else None
        by_id = {s.id: s for s in seqs}
        if self.resume_from is not None:  # the run's own split, even if data was added since
            split = trainer_state(self.resume_from)["split"]
            train_ids, self.held_ids = split["train"], split["held_out"]
            missing = [i for i in train_ids + self.held_ids if i not in by_id]
            if missing:
                raise TrainError(f"cannot resume: record {missing[0]!r} is no longer in the data")
            seqs = [by_id[i] for i in train_ids + self.held_ids]
        else:  # held out: the target's own text, where acceptance is measured exactly
            own = [s.id for s in seqs if not s.target_labels] or [s.id for s in seqs]
            self.held_ids = split_holdout(own, cfg.eval_seqs)[1]
            held = set(self.held_ids)
            train_ids = [s.id for s in seqs if s.id not in held]
        self.train_seqs = [by_id[i] for i in train_ids]
        self.epoch_seqs = repeat_by_folder(self.train_seqs, cfg.repeats())
        base_dir = self.resume_from or (Path(cfg.init_from) if cfg.init_from else None)
        saved: tuple[DrafterConfig, dict[str, torch.Tensor]] | None = None
        if base_dir is not None:
            try:
                saved = saved_drafter(base_dir)
            except DrafterConfigError as e:
                raise TrainError(str(e)) from None
        if cfg.carryover and saved is None:
            raise TrainError("the Carryover stage continues a baseline drafter: set init_from")
        taps = (
            saved[0].tap_layer_ids
            if saved
            else tuple(default_tap_layer_ids(self.target_cfg.num_layers, cfg.num_taps))
        )
        runner = TargetRunner(
            TargetSpec(str(self.target_path), kv_cache_tokens=16, tap_layer_ids=taps)
        )
        self.target_cfg = runner.cfg
        self.target = TargetPass(runner.model)

        self.cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else self.out / "tap_cache"
        self.cache, self.cache_stats = build_tap_cache(
            self.cache_dir, seqs, self.target, cfg.cache_dtype, cfg.progress
        )
        self.net, self.coverage = self._build_net(saved)

    def _build_net(
        self, saved: tuple[DrafterConfig, dict[str, torch.Tensor]] | None
    ) -> tuple[DrafterNetwork, float]:
        cfg, t = self.cfg, self.target_cfg
        if saved is not None:
            dcfg = dataclasses.replace(
                saved[0],
                block_size=cfg.k,
                carry=cfg.carryover,
                boundary_input=saved[0].boundary_input or cfg.boundary_input,
                copy_input=saved[0].copy_input or cfg.copy_input,
            )
            d2t = saved[1]["d2t"]
            if cfg.revocab and self.resume_from is None:  # a resumed run keeps its own d2t
                d2t = self._pick_draft_vocab()[0]
                saved = (saved[0], remap_draft_vocab(saved[1], d2t))
                dcfg = dataclasses.replace(dcfg, draft_vocab_size=len(d2t))
            if self.resume_from is None:  # a resumed run already has its widths
                dcfg, grown = grow_weights(
                    dcfg, saved[1], cfg.mlp_width, cfg.markov_rank, cfg.seed, cfg.init_std
                )
                saved = (saved[0], grown)
            coverage = _coverage(self.train_seqs, d2t)
        else:
            d2t, coverage = self._pick_draft_vocab()
            widths = {"mlp_width": cfg.mlp_width, "markov_rank": cfg.markov_rank}
            extra = {name: w for name, w in widths.items() if w}  # 0: DrafterConfig's default
            dcfg = DrafterConfig.for_target(
                t,
                window=cfg.window,
                summary_slots=cfg.summary_slots,
                block_size=cfg.k,
                draft_vocab_size=len(d2t),
                carry=cfg.carryover,
                boundary_input=cfg.boundary_input,
                copy_input=cfg.copy_input,
                **extra,
            )
        try:
            net = DrafterNetwork(dcfg, t)
        except DrafterConfigError as e:
            raise TrainError(str(e)) from None
        if saved is not None:
            added = _added_inputs(saved[0], dcfg)
            if added:
                net.init_random(cfg.seed, cfg.init_std)  # the added inputs' initial weights
                keys = net.load_state_dict(saved[1], strict=False)
                if keys.unexpected_keys or sorted(keys.missing_keys) != added:
                    raise TrainError(f"cannot extend the drafter: {keys}")
            else:
                net.load_state_dict(saved[1])
        else:
            net.init_random(cfg.seed, cfg.init_std)
        net.set_target_weights(*load_target_head(self.target_path, t), d2t)
        return net.train(), coverage

    def _pick_draft_vocab(self) -> tuple[torch.Tensor, float]:
        """The draft vocabulary (and its coverage) picked from the target-written sequences."""
        t = self.target_cfg
        own = [s for s in self.train_seqs if not s.target_labels] or self.train_seqs
        return draft_vocabulary(own, self.cfg.draft_vocab, t.vocab_size, tuple(t.eos_token_ids))

    # -- data --------------------------------------------------------------------------

    def batch(self, step: int) -> tuple[Batch, Anchors]:
        """The sequences and anchors of ``step``: a pure function of ``(seed, step)``."""
        cfg, n = self.cfg, len(self.epoch_seqs)
        picks = []
        for i in range(cfg.seqs_per_step):
            p = step * cfg.seqs_per_step + i
            perm = torch.randperm(n, generator=_gen(cfg.seed, 1, p // n))
            picks.append(self.epoch_seqs[int(perm[p % n])])
        gen = _gen(cfg.seed, 2, step)
        items = [self.cache.get(s.id) for s in picks]
        nexts = [self.cache.next_tokens(s.id) if s.target_labels else None for s in picks]
        anchors = [
            sample_anchors(len(s.tokens), s.prompt_len, cfg.anchors_per_seq, gen) for s in picks
        ]
        return Batch.collate(items, nexts), Anchors.pad(anchors)

    # -- one step ----------------------------------------------------------------------

    def loss(self, batch: Batch, anchors: Anchors) -> tuple[torch.Tensor, BlockStats, dict]:
        cfg = self.cfg
        extra: dict[str, Any] = {}
        carry = carry_mask = first = None
        first_loss = torch.zeros(())
        if cfg.carryover:
            if cfg.carryover_first_weight > 0:  # the first draft learns at its anchors too
                views = build_views(self.net, batch, anchors, cfg.summary_chunk)
                first = (views, block_logits(self.net, views, batch, cfg.k))
                first_loss, first_stats = self._block_loss(batch, views, first[1])
                extra["first_loss"] = first_loss.item()
                extra["first_tau"] = round(first_stats.tau, 4)
            anchors, carry, carry_mask, verified = draft_verify(
                self.net, self.target, batch, anchors, cfg.k, cfg.summary_chunk, first
            )
            extra.update(verified)
        views = build_views(self.net, batch, anchors, cfg.summary_chunk, carry, carry_mask)
        loss, stats = self._block_loss(batch, views, block_logits(self.net, views, batch, cfg.k))
        loss = loss + cfg.carryover_first_weight * first_loss
        return loss, stats, {"anchors": len(views.pos), **extra}

    def _block_loss(
        self, batch: Batch, views: AnchorViews, base: torch.Tensor
    ) -> tuple[torch.Tensor, BlockStats]:
        cfg = self.cfg
        labels, valid = block_labels(batch, views, cfg.k)
        return block_loss(
            self.net,
            base,
            batch.tokens[views.seq, views.pos],
            labels,
            valid,
            cfg.gamma,
            cfg.base_loss_weight,
            cfg.markov_loss_weight,
        )

    # -- the loop ----------------------------------------------------------------------

    def run(self) -> Path:
        from tqdm import tqdm

        cfg = self.cfg
        opt = torch.optim.AdamW(
            _param_groups(self.net, cfg.weight_decay),
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            foreach=True,
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule(cfg))
        start = 0
        if self.resume_from is not None:
            state = load_checkpoint(self.resume_from, self.net, opt, sched)
            diff = cfg.differences(state["train_config"])
            if diff:
                raise TrainError(f"cannot resume {self.resume_from} with other settings: {diff[0]}")
            start = int(state["step"])
            log.info("resuming from %s at step %d", self.resume_from, start)
        self.out.mkdir(parents=True, exist_ok=True)
        log_path = self.out / LOG_NAME
        _truncate_log(log_path, start)
        bar = tqdm(total=cfg.steps, initial=start, disable=not cfg.progress, unit="step")
        t_start = time.perf_counter()
        with log_path.open("a") as log_file:
            for step in range(start, cfg.steps):
                t0 = time.perf_counter()
                batch, anchors = self.batch(step)
                loss, stats, extra = self.loss(batch, anchors)
                if not torch.isfinite(loss):
                    raise TrainError(f"the loss is {loss.item()} at step {step + 1}: lower lr")
                opt.zero_grad(set_to_none=True)
                loss.backward()
                gnorm = (
                    float(torch.nn.utils.clip_grad_norm_(self.net.parameters(), cfg.grad_clip))
                    if cfg.grad_clip > 0
                    else float("nan")
                )
                lr = opt.param_groups[0]["lr"]
                opt.step()
                sched.step()
                done = step + 1
                row = {
                    "step": done,
                    "loss": loss.item(),
                    "ce_base": stats.ce_base,
                    "ce_markov": stats.ce_markov,
                    "acc": [round(a, 4) for a in stats.acc],
                    "tau": round(stats.tau, 4),
                    "lr": lr,
                    "grad_norm": gnorm,
                    "seconds": round(time.perf_counter() - t0, 3),
                    "elapsed": round(time.perf_counter() - t_start, 1),
                    **extra,
                }
                if done % cfg.log_every == 0 or done == cfg.steps:
                    log_file.write(json.dumps(row) + "\n")
                    log_file.flush()
                bar.update(1)
                bar.set_postfix(loss=f"{row['loss']:.3f}", tau=f"{stats.tau:.2f}", refresh=False)
                if (cfg.ckpt_every and done % cfg.ckpt_every == 0) or done == cfg.steps:
                    save_checkpoint(
                        self.out, done, self.net, opt, sched, self.state(), cfg.keep_ckpts
                    )
        bar.close()
        return self.save_final()

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps besides weights and optimizer: config and data split."""
        split = {"train": [s.id for s in self.train_seqs], "held_out": list(self.held_ids)}
        return {"train_config": self.cfg.to_dict(), "split": split}

    def save_final(self) -> Path:
        save_drafter(self.out, self.net.cfg, self.net.state_dict(), "float32")
        info = {
            **self.cfg.to_dict(),
            "target_path": str(self.target_path),
            "cache_dir": str(self.cache_dir),
            "num_train_seqs": len(self.train_seqs),
            "num_heldout_seqs": len(self.held_ids),
            "draft_vocab_size": self.net.cfg.draft_vocab_size,
            "draft_vocab_coverage": round(self.coverage, 5),
            "drafter_parameters": self.net.num_parameters(),
            "tap_cache_build": self.cache_stats,
        }
        (self.out / TRAIN_CONFIG).write_text(json.dumps(info, indent=2) + "\n")
        (self.out / HOLDOUT).write_text(json.dumps(self.held_ids) + "\n")
        return self.out


def train_drafter(cfg: TrainConfig) -> Path:
    """Train a LongSpark drafter (baseline, or Carryover from ``cfg.init_from``).

    Returns ``cfg.out``, which then holds the drafter (``config.json`` +
    ``model.safetensors``, loadable with ``Drafter.from_pretrained``), ``train_config.json``,
    ``holdout_ids.json``, ``train_log.jsonl`` and ``ckpt/``.
    """
    threads = torch.get_num_threads()
    try:
        return Trainer(cfg).run()
    finally:
        torch.set_num_threads(threads)


# -- helpers -------------------------------------------------------------------------------


def _gen(seed: int, stream: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + stream) * 1_000_000_007 + index)


def _param_groups(net: DrafterNetwork, weight_decay: float) -> list[dict]:
    decay, plain = [], []
    for name, p in net.named_parameters():
        (decay if p.dim() >= 2 and name != "summary_queries" else plain).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]


def _schedule(cfg: TrainConfig):
    warm = max(1, int(round(cfg.warmup_ratio * cfg.steps)))

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = min(1.0, (step - warm) / max(1, cfg.steps - warm))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _added_inputs(saved: DrafterConfig, new: DrafterConfig) -> list[str]:
    """The weights of block inputs ``new`` reads and ``saved`` did not (``init_random``'s)."""
    added = []
    if new.boundary_input and not saved.boundary_input:
        added.append("boundary_proj.weight")
    if new.copy_input and not saved.copy_input:
        added += ["copy_bias", "copy_proj.weight"]
    return sorted(added)


def _coverage(seqs: list[Sequence], d2t: torch.Tensor) -> float:
    inside = set(d2t.tolist())
    total = hits = 0
    for s in seqs:
        resp = s.tokens[s.prompt_len :]
        total += len(resp)
        hits += sum(t in inside for t in resp)
    return hits / max(1, total)


def _truncate_log(path: Path, step: int) -> None:
    """Keep the log lines of steps ``<= step`` (a resumed run rewrites what followed)."""
    if not path.is_file():
        return
    keep = [
        line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step
    ]
    path.write_text("".join(line + "\n" for line in keep))


__all__ = ["Trainer", "train_drafter"]
