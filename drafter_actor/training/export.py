"""Export a trained drafter as a shippable folder: its own weights only, no machine paths.

A training run (or one of its checkpoints) holds ``config.json`` + ``model.safetensors``
with every drafter-owned tensor (the target's embedding and LM head are never saved: the
drafter shares them at load time). Exporting rewrites the weights in ``dtype`` (bf16
halves the size; the drafter computes in fp32 after loading) and copies the run's
training settings into ``training.json`` without the paths that only meant something on
the machine that trained it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from drafter_actor.checkpoint import WEIGHTS_NAME, save_drafter
from drafter_actor.config import DrafterConfigError
from drafter_actor.training.checkpoint import list_checkpoints, saved_drafter, trainer_state
from drafter_actor.training.config import TrainError
from drafter_actor.training.trainer import TRAIN_CONFIG

TRAINING_INFO = "training.json"
LOCAL_KEYS = ("out", "data_dir", "target", "target_path", "cache_dir", "init_from")


def export_drafter(
    run: str | Path,
    out: str | Path,
    dtype: str = "bfloat16",
    step: int | None = None,
    context_copy: bool = True,
    copy_sure_ngram: int | None = None,
) -> dict[str, Any]:
    """Write the drafter of ``run`` (its final weights, or checkpoint ``step``) to ``out``,
    with context copy switched on (``context_copy``) as it is served; ``copy_sure_ngram``
    (if given) sets the match length that replaces the network's drafts."""
    run = Path(run)
    src = run if step is None else _checkpoint(run, step)
    try:
        cfg, weights = saved_drafter(src)
        cfg = dataclasses.replace(cfg, context_copy=context_copy)
        if copy_sure_ngram is not None:
            cfg = dataclasses.replace(cfg, copy_sure_ngram=copy_sure_ngram)
        save_drafter(out, cfg, weights, dtype)
    except (DrafterConfigError, OSError) as e:
        raise TrainError(f"cannot export {src}: {e}") from None
    info_path = run / TRAIN_CONFIG
    if step is not None:  # the settings the checkpoint was trained with
        info = dict(trainer_state(src)["train_config"])
    else:
        info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    for key in LOCAL_KEYS:
        info.pop(key, None)
    info["exported_step"] = step or info.get("steps")
    info["exported_dtype"] = dtype
    (Path(out) / TRAINING_INFO).write_text(json.dumps(info, indent=2) + "\n")
    return {
        "out": str(out),
        "step": info["exported_step"],
        "dtype": dtype,
        "parameters": sum(t.numel() for t in weights.values() if t.is_floating_point()),
        "bytes": (Path(out) / WEIGHTS_NAME).stat().st_size,
    }


def _checkpoint(run: Path, step: int) -> Path:
    for path in list_checkpoints(run):
        if path.name == f"step-{step:07d}":
            return path
    raise TrainError(f"{run} has no checkpoint at step {step}")


__all__ = ["export_drafter"]
