"""Drafter checkpoints: a Hugging Face style folder with ``config.json`` + ``model.safetensors``.

The folder holds only drafter-owned weights (and ``d2t``); the token embedding and LM head
are read from the target checkpoint at load time. ``config.json`` carries the view sizes
and the target fingerprint, checked against the target on load.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from drafter_actor.config import DrafterConfig, DrafterConfigError
from target_actor.config import ModelConfig
from target_actor.weights import CheckpointReader

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
ARCHITECTURE = "LongSparkDrafter"
SAVE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def save_drafter(
    folder: str | Path,
    cfg: DrafterConfig,
    state_dict: dict[str, torch.Tensor],
    dtype: str = "float32",
) -> None:
    """Write ``config.json`` and ``model.safetensors`` (floats in ``dtype``) into ``folder``."""
    if dtype not in SAVE_DTYPES:
        raise DrafterConfigError(f"unknown dtype {dtype!r}; choose from {', '.join(SAVE_DTYPES)}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {  # in host memory, whatever device the drafter runs on
        name: t.to("cpu", SAVE_DTYPES[dtype] if t.is_floating_point() else t.dtype).contiguous()
        for name, t in state_dict.items()
    }
    save_file(tensors, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
    meta = {"architectures": [ARCHITECTURE], "model_type": "longspark_drafter", "dtype": dtype}
    (folder / CONFIG_NAME).write_text(json.dumps({**meta, **cfg.to_dict()}, indent=2) + "\n")


def load_drafter_weights(
    folder: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """Read a drafter folder: its config and its weights (floats cast to ``dtype``)."""
    folder = Path(folder)
    cfg_path, weights_path = folder / CONFIG_NAME, folder / WEIGHTS_NAME
    if not cfg_path.is_file() or not weights_path.is_file():
        raise DrafterConfigError(
            f"{folder} is not a drafter checkpoint (need {CONFIG_NAME} and {WEIGHTS_NAME})"
        )
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise DrafterConfigError(f"{cfg_path} is not valid JSON: {e}") from None
    if raw.get("architectures") != [ARCHITECTURE]:
        raise DrafterConfigError(f"{cfg_path} is not a {ARCHITECTURE} config")
    cfg = DrafterConfig.from_dict(raw)
    try:
        weights = load_file(str(weights_path))
    except (SafetensorError, OSError) as e:
        raise DrafterConfigError(f"{weights_path} is unreadable: {e}") from None
    return cfg, {n: t.to(dtype) if t.is_floating_point() else t for n, t in weights.items()}


def load_target_head(
    target_dir: str | Path, target: ModelConfig, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's token embedding and LM head ``[V, d]`` (the same tensor when tied)."""
    reader = CheckpointReader(target_dir, dtype)
    try:
        embed = reader.get("model.embed_tokens.weight")
        head = embed if target.tie_word_embeddings else reader.get("lm_head.weight")
    finally:
        reader.close()
    return embed, head
