"""Drafter configuration: the view sizes, the heads, and the target it was built for.

A drafter only works with the target whose hidden and key/value spaces it reads, so the
config carries a ``TargetFingerprint`` (architecture, geometry, vocabulary, RoPE base)
that is checked against the target when a checkpoint is loaded.

Notation: ``L`` tapped layers (= drafter layers), ``W`` window rows, ``R`` summary
slots, ``r`` Markov rank, ``k`` draft tokens per block, ``K_q`` proposal support.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from target_actor.config import ModelConfig
from target_actor.errors import LongSparkError


class DrafterConfigError(LongSparkError, ValueError):
    """The drafter config or checkpoint cannot be used (one-line message)."""


@dataclass(frozen=True)
class TargetFingerprint:
    """What a drafter must agree on with its target to read the target's spaces."""

    arch: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_layers: int
    rope_theta: float

    @classmethod
    def of(cls, cfg: ModelConfig) -> TargetFingerprint:
        return cls(
            arch=cfg.arch,
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            vocab_size=cfg.vocab_size,
            num_layers=cfg.num_layers,
            rope_theta=cfg.rope_theta,
        )

    def mismatches(self, other: TargetFingerprint) -> list[str]:
        """``"field drafter!=target"`` for every field that differs."""
        return [
            f"{f.name} {getattr(self, f.name)}!={getattr(other, f.name)}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]


@dataclass(frozen=True)
class DrafterConfig:
    """Sizes of the drafter's views and heads. Build one with :meth:`for_target`."""

    target: TargetFingerprint
    tap_layer_ids: tuple[int, ...]  # target layers tapped, one drafter layer each (L)
    mlp_width: int  # drafter MLP width (default: target intermediate_size // 2)
    draft_vocab_size: int  # |d2t|; == target vocab for the full vocabulary
    rms_norm_eps: float = 1e-6
    qk_norm: bool = False  # per-head q/k RMSNorm, as the target (Qwen3) has
    window: int = 256  # W: recent K/V rows per tapped layer
    summary_slots: int = 16  # R: learned summary queries per layer and head
    markov_rank: int = 64  # r: rank of the Markov head's transition bias
    block_size: int = 15  # k: the most draft tokens per block (and carry rows)
    proposal_support: int = 8  # K_q: ids per slot in the shipped proposal q
    carry: bool = True  # carryover of the rejected positions' hidden states
    boundary_input: bool = False  # also add the boundary state to every block row's input
    context_copy: bool = False  # draft recent n-gram continuations where sure (context_copy.py)
    copy_input: bool = False  # the network also reads the copy candidates in its MASK rows
    # a context-copy match this long replaces the network's drafts (context_copy.py); a
    # network that reads the copy inputs drafts better than short matches do
    copy_sure_ngram: int = 2

    def __post_init__(self) -> None:
        t = self.target
        if not self.tap_layer_ids:
            raise DrafterConfigError("a drafter needs at least one tapped target layer")
        if list(self.tap_layer_ids) != sorted(set(self.tap_layer_ids)):
            raise DrafterConfigError(f"tap layer ids must be increasing: {self.tap_layer_ids}")
        if not all(0 <= i < t.num_layers for i in self.tap_layer_ids):
            raise DrafterConfigError(
                f"tap layer ids {self.tap_layer_ids} outside the target's 0..{t.num_layers - 1}"
            )
        positive = ("mlp_width", "window", "summary_slots", "markov_rank", "block_size")
        for name in positive + ("copy_sure_ngram",):
            if getattr(self, name) < 1:
                raise DrafterConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.draft_vocab_size <= t.vocab_size:
            raise DrafterConfigError(
                f"draft_vocab_size {self.draft_vocab_size} outside 1..{t.vocab_size}"
            )
        if not 1 <= self.proposal_support <= self.draft_vocab_size:
            raise DrafterConfigError(
                f"proposal_support {self.proposal_support} outside 1..{self.draft_vocab_size}"
            )

    @property
    def num_layers(self) -> int:
        return len(self.tap_layer_ids)

    @property
    def full_vocab(self) -> bool:
        return self.draft_vocab_size == self.target.vocab_size

    @classmethod
    def for_target(cls, cfg: ModelConfig, **overrides: Any) -> DrafterConfig:
        """Defaults for ``cfg``'s geometry; ``overrides`` set any other field."""
        fields = dict(
            target=TargetFingerprint.of(cfg),
            tap_layer_ids=tuple(cfg.tap_layer_ids),
            mlp_width=max(1, cfg.intermediate_size // 2),
            draft_vocab_size=cfg.vocab_size,
            rms_norm_eps=cfg.rms_norm_eps,
            qk_norm=cfg.qk_norm,
        )
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise DrafterConfigError(f"unknown drafter config fields: {sorted(unknown)}")
        fields.update(overrides)
        fields["tap_layer_ids"] = tuple(int(i) for i in fields["tap_layer_ids"])
        return cls(**fields)

    def check_target(self, cfg: ModelConfig) -> None:
        """Raise ``DrafterConfigError`` unless ``cfg`` is the target this drafter reads."""
        diff = self.target.mismatches(TargetFingerprint.of(cfg))
        if diff:
            raise DrafterConfigError(
                f"drafter does not match the target (drafter!=target): {', '.join(diff)}"
            )
        if cfg.qk_norm != self.qk_norm:
            raise DrafterConfigError(f"qk_norm {self.qk_norm}!={cfg.qk_norm}")

    def check_taps(self, tap_layer_ids: tuple[int, ...] | list[int]) -> None:
        """Raise ``DrafterConfigError`` unless the target taps exactly this drafter's layers."""
        if tuple(tap_layer_ids) != self.tap_layer_ids:
            raise DrafterConfigError(
                f"target taps layers {tuple(tap_layer_ids)}, drafter reads {self.tap_layer_ids}"
            )

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["tap_layer_ids"] = list(self.tap_layer_ids)
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DrafterConfig:
        try:
            raw = dict(raw)
            target = TargetFingerprint(**raw.pop("target"))
            known = {f.name for f in dataclasses.fields(cls)}
            fields = {key: value for key, value in raw.items() if key in known}
            fields["tap_layer_ids"] = tuple(int(i) for i in fields["tap_layer_ids"])
            return cls(target=target, **fields)
        except (KeyError, TypeError) as e:
            raise DrafterConfigError(f"drafter config is incomplete or malformed: {e}") from None
