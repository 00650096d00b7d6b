"""Training settings: one dataclass, every field with a help string.

``TrainConfig`` is what ``train_drafter`` takes; ``add_train_args`` / ``from_args`` turn its
fields into argparse options (``--anchors-per-seq`` for ``anchors_per_seq``) so a CLI can
expose all of them without repeating the help texts. Checks live in ``__post_init__`` and
raise ``TrainError`` with a one-line message.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from target_actor.errors import LongSparkError

MAX_K = 16  # the longest block trained (the engine's k is at most the drafter's block_size)
CACHE_DTYPES = ("float16", "bfloat16", "float32")
# fields that may change between a run and its resumption
RESUMABLE_CHANGES = {"steps", "ckpt_every", "keep_ckpts", "log_every", "resume", "threads"}
RESUMABLE_CHANGES |= {"progress", "cache_dir", "data_dir", "target", "out"}


class TrainError(LongSparkError, ValueError):
    """Bad training inputs or settings (one-line message)."""


def data_folders(spec: str) -> list[str]:
    """The folders of a ``data_dir`` setting: one path, or several separated by commas."""
    folders = [d.strip() for d in str(spec).split(",") if d.strip()]
    if not folders:
        raise TrainError("no data folder given")
    return folders


def _f(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class TrainConfig:
    """Everything ``train_drafter`` needs. Defaults fit SmolLM2-135M on 2 CPU cores."""

    data_dir: str = _f(
        "", "training data folder(s), comma-separated (each: manifest.json + shard-*.jsonl)"
    )
    out: str = _f("", "output folder: the drafter, ckpt/, tap_cache/, train_log.jsonl")
    target: str | None = _f(None, "target model folder (default: SmolLM2-135M-Instruct)")
    cache_dir: str | None = _f(None, "tap cache folder (default: <out>/tap_cache)")
    cache_dtype: str = _f("float16", "dtype of the cached target taps: float16|bfloat16|float32")
    max_len: int = _f(768, "tokens per sequence (prompt + response); longer ones are cut")
    max_seqs: int = _f(0, "use at most this many records (0 = all)")
    eval_seqs: int = _f(32, "records held out of training for evaluate_tau")
    data_repeat: str = _f(
        "",
        "times each data folder's sequences enter an epoch, comma-separated in data_dir's "
        "order (empty: once each); 1,1,3 visits a newly added third folder 3x as often",
    )

    # -- the drafter ------------------------------------------------------------------
    num_taps: int = _f(4, "tapped target layers = drafter layers")
    window: int = _f(256, "W: recent K/V rows per tapped layer")
    summary_slots: int = _f(16, "R: summary queries per layer and head")
    markov_rank: int = _f(
        0,
        "r: rank of the Markov head (0 = 64; with init_from: 0 keeps the drafter's, a larger "
        "rank grows the head, starting as the same function)",
    )
    mlp_width: int = _f(
        0,
        "drafter MLP width (0 = target intermediate_size // 2; with init_from: 0 keeps "
        "the drafter's, a larger width grows every layer's MLP, starting as the same function)",
    )
    draft_vocab: int = _f(8192, "reduced draft vocabulary size, by response frequency (0 = full)")
    revocab: bool = _f(
        False,
        "with init_from: re-pick the draft vocabulary (the draft_vocab most frequent response "
        "tokens of this data); the Markov head keeps the rows of tokens in both",
    )
    init_std: float = _f(0.02, "std of the random initial weights")
    boundary_input: bool = _f(
        False, "also feed the boundary state into the block rows (added to init_from drafters)"
    )
    copy_input: bool = _f(
        False, "feed context-copy candidates into the MASK rows (can extend init_from drafters)"
    )

    # -- the objective ----------------------------------------------------------------
    k: int = _f(7, "draft tokens per block trained (and the drafter's block_size)")
    gamma: float = _f(4.0, "slot weights w_i = exp(-(i-1)/gamma)")
    base_loss_weight: float = _f(1.0, "weight of the CE of the base (parallel) logits")
    markov_loss_weight: float = _f(1.0, "weight of the CE of the Markov-corrected logits")
    anchors_per_seq: int = _f(64, "random anchors per response (fewer for short responses)")
    seqs_per_step: int = _f(4, "sequences per optimizer step (all their anchors in one pass)")
    summary_chunk: int = _f(32, "chunk length of the causal prefix scan of the summary")

    # -- optimisation -----------------------------------------------------------------
    steps: int = _f(1000, "optimizer steps")
    lr: float = _f(6e-4, "peak learning rate (AdamW)")
    warmup_ratio: float = _f(0.04, "linear warmup, as a fraction of steps")
    min_lr_ratio: float = _f(0.1, "cosine decay ends at lr * min_lr_ratio")
    weight_decay: float = _f(0.01, "AdamW weight decay (matrices only)")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    grad_clip: float = _f(1.0, "gradient-norm clip (0 = off)")
    seed: int = _f(0, "seed of the initial weights, the data order and the anchors")

    # -- bookkeeping ------------------------------------------------------------------
    ckpt_every: int = _f(200, "save a resumable checkpoint every N steps (0 = only at the end)")
    keep_ckpts: int = _f(2, "checkpoints kept in <out>/ckpt")
    log_every: int = _f(1, "write a train_log.jsonl line every N steps")
    resume: bool = _f(False, "continue from the latest checkpoint in <out>/ckpt")
    threads: int = _f(0, "torch threads (0 = torch's default)")
    progress: bool = _f(True, "show progress bars")

    # -- Carryover --------------------------------------------------------------------
    carryover: bool = _f(False, "Carryover stage: draft-verify-draft with rejected states")
    init_from: str | None = _f(None, "baseline drafter folder the Carryover stage continues")
    carryover_first_weight: float = _f(
        0.0,
        "Carryover: weight of the first draft's own block loss at the original anchors "
        "(0 = the paper: gradients through the second draft only)",
    )

    def repeats(self) -> tuple[int, ...]:
        """``data_repeat`` as one count per data folder (``()``: once each)."""
        if not self.data_repeat.strip():
            return ()
        try:
            counts = tuple(int(c) for c in self.data_repeat.split(","))
        except ValueError:
            raise TrainError(
                f"data_repeat {self.data_repeat!r}: not comma-separated integers"
            ) from None
        folders = data_folders(self.data_dir)
        if len(counts) != len(folders) or min(counts) < 1:
            raise TrainError(
                f"data_repeat {self.data_repeat!r}: one count >= 1 for each of the "
                f"{len(folders)} data folders"
            )
        return counts

    def __post_init__(self) -> None:
        if not self.data_dir:
            raise TrainError("data_dir is required")
        if not self.out:
            raise TrainError("out is required")
        if not 1 <= self.k <= MAX_K:
            raise TrainError(f"k={self.k} outside 1..{MAX_K}")
        if self.cache_dtype not in CACHE_DTYPES:
            raise TrainError(f"cache_dtype {self.cache_dtype!r} not in {', '.join(CACHE_DTYPES)}")
        positive = ("max_len", "num_taps", "window", "summary_slots", "steps")
        positive += ("anchors_per_seq", "seqs_per_step", "summary_chunk", "keep_ckpts")
        positive += ("log_every",)
        for name in positive:
            if getattr(self, name) < 1:
                raise TrainError(f"{name} must be >= 1, got {getattr(self, name)}")
        non_negative = ("max_seqs", "eval_seqs", "mlp_width", "markov_rank", "draft_vocab")
        for name in (*non_negative, "ckpt_every"):
            if getattr(self, name) < 0:
                raise TrainError(f"{name} must be >= 0, got {getattr(self, name)}")
        self.repeats()  # checks the spelling
        if self.max_len < self.k + 2:
            raise TrainError(f"max_len={self.max_len} leaves no room for a block of k={self.k}")
        if not (self.lr > 0 and self.gamma > 0 and self.init_std > 0):
            raise TrainError("lr, gamma and init_std must be > 0")
        if not (0 <= self.warmup_ratio < 1 and 0 <= self.min_lr_ratio <= 1):
            raise TrainError("warmup_ratio must lie in [0, 1) and min_lr_ratio in [0, 1]")
        if self.base_loss_weight < 0 or self.markov_loss_weight < 0:
            raise TrainError("loss weights must be >= 0")
        if self.base_loss_weight + self.markov_loss_weight == 0:
            raise TrainError("at least one loss weight must be > 0")
        if self.carryover_first_weight < 0:
            raise TrainError("carryover_first_weight must be >= 0")
        if self.carryover_first_weight > 0 and not self.carryover:
            raise TrainError("carryover_first_weight needs the Carryover stage (--carryover)")
        if self.revocab and not self.init_from:
            raise TrainError("revocab re-picks an init_from drafter's vocabulary: set init_from")
        if self.carryover and not self.init_from and not self.resume:
            raise TrainError("the Carryover stage continues a baseline drafter: set init_from")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def differences(self, saved: dict[str, Any]) -> list[str]:
        """Fields (other than the resumable ones) whose value differs from ``saved``.

        A field missing from ``saved`` (written before the field existed) counts as its default.
        """
        return [
            f"{f.name} {saved.get(f.name, f.default)!r}->{getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if f.name not in RESUMABLE_CHANGES
            and saved.get(f.name, f.default) != getattr(self, f.name)
        ]


ALIASES = {"data_dir": ("--data",)}  # the documented short spelling


def add_train_args(parser: argparse.ArgumentParser) -> None:
    """One ``--option`` per ``TrainConfig`` field, with its help string and default."""
    for f in dataclasses.fields(TrainConfig):
        flags = ("--" + f.name.replace("_", "-"), *ALIASES.get(f.name, ()))
        help_text = f.metadata.get("help", "")
        if f.type in ("bool", bool):
            parser.add_argument(
                *flags, action=argparse.BooleanOptionalAction, default=f.default, help=help_text
            )
            continue
        kind = {"int": int, "float": float}.get(str(f.type), str)
        required = f.name in ("data_dir", "out")
        parser.add_argument(
            *flags,
            dest=f.name,
            type=kind,
            default=None if required else f.default,
            required=required,
            help=help_text if required else f"{help_text} (default: {f.default})",
        )


def from_args(ns: argparse.Namespace) -> TrainConfig:
    """The ``TrainConfig`` of parsed ``add_train_args`` options."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{n: v for n, v in vars(ns).items() if n in names})
