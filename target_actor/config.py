"""Target model configuration, read from a Hugging Face folder's ``config.json``.

Only the fields the decoder needs are kept. transformers is not used here: reading the
JSON ourselves keeps the engine independent of transformers' config renames (v5 moved
``rope_theta`` / ``rope_scaling`` into ``rope_parameters``; both spellings are read).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import LongSparkError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
DEFAULT_NUM_TAPS = 4


class TargetConfigError(LongSparkError, ValueError):
    """The checkpoint or the requested settings cannot be served (one-line message)."""


def default_tap_layer_ids(num_layers: int, num_taps: int) -> list[int]:
    """Evenly spaced target layers to tap (DFlash's ``build_target_layer_ids``).

    Skips the first and the last few layers, which carry little drafting signal.
    """
    if num_taps < 1:
        raise TargetConfigError(f"need at least one tapped layer, got {num_taps}")
    if num_taps == 1:
        return [num_layers // 2]
    start, end = 1, max(1, num_layers - 3)
    span = end - start
    ids = [int(round(start + i * span / (num_taps - 1))) for i in range(num_taps)]
    return sorted(set(min(max(i, 0), num_layers - 1) for i in ids))


@dataclass(frozen=True)
class ModelConfig:
    """Geometry of a Llama / Qwen2 / Qwen3 decoder."""

    arch: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool = False
    rope_scaling: dict[str, Any] | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    tap_layer_ids: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise TargetConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        for i in self.tap_layer_ids:
            if not 0 <= i < self.num_layers:
                raise TargetConfigError(f"tap layer {i} outside 0..{self.num_layers - 1}")

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def check_tp(self, tp: int) -> None:
        """A TP degree must divide query heads, KV heads and the MLP width."""
        if tp < 1:
            raise TargetConfigError(f"tensor-parallel degree must be >= 1, got {tp}")
        for name, n in (
            ("attention heads", self.num_heads),
            ("KV heads", self.num_kv_heads),
            ("intermediate size", self.intermediate_size),
        ):
            if n % tp:
                raise TargetConfigError(
                    f"tensor-parallel degree {tp} does not divide the model's {name} ({n})"
                )

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """Bytes of K and V for one token over all layers (whole model, not one rank)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_dict(cls, raw: dict[str, Any], num_taps: int = DEFAULT_NUM_TAPS) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next(
            (SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None
        )
        if arch is None:
            arch = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}.get(
                raw.get("model_type", "")
            )
        if arch is None:
            got = archs or raw.get("model_type")
            raise TargetConfigError(
                f"unsupported architecture {got!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            layers = int(raw["num_hidden_layers"])
            rope = dict(raw.get("rope_parameters") or {})
            legacy_scaling = raw.get("rope_scaling") or None
            theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
            scaling = legacy_scaling or {k: v for k, v in rope.items() if k != "rope_theta"}
            if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
                scaling = None
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            taps = raw.get("longspark_tap_layer_ids") or default_tap_layer_ids(layers, num_taps)
            return cls(
                arch=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qk_norm=arch == "qwen3",
                rope_scaling=dict(scaling) if scaling else None,
                eos_token_ids=eos_ids,
                bos_token_id=raw.get("bos_token_id"),
                tap_layer_ids=tuple(int(i) for i in taps),
            )
        except KeyError as e:
            raise TargetConfigError(f"config.json lacks required field {e.args[0]!r}") from None

    @classmethod
    def from_pretrained(cls, path: str | Path, num_taps: int = DEFAULT_NUM_TAPS) -> ModelConfig:
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise TargetConfigError(f"{path} is not a Hugging Face model folder (no config.json)")
        try:
            raw = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise TargetConfigError(f"{cfg_path} is not valid JSON: {e}") from None
        return cls.from_dict(raw, num_taps)
