"""Resumable training checkpoints under ``<out>/ckpt/step-NNNNNNN/``.

Each holds the drafter in its Hugging Face layout (``config.json`` + ``model.safetensors``,
fp32, so weights come back bit-exactly) and ``trainer.pt``: optimizer and scheduler
state, torch's RNG state, the step and the training config. A checkpoint is written to a
``.tmp`` folder and renamed, so a killed run never leaves half of one; only the newest
``keep`` are kept. Batches and anchors are a pure function of ``(seed, step)``, so a
resumed run repeats exactly the steps it would have taken.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from drafter_actor.checkpoint import load_drafter_weights, save_drafter
from drafter_actor.config import DrafterConfig
from drafter_actor.network import DrafterNetwork

TRAINER_STATE = "trainer.pt"


def ckpt_root(out: str | Path) -> Path:
    return Path(out) / "ckpt"


def list_checkpoints(out: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = ckpt_root(out)
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step-*") if p.is_dir() and (p / TRAINER_STATE).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def save_checkpoint(
    out: str | Path,
    step: int,
    net: DrafterNetwork,
    opt: torch.optim.Optimizer,
    sched: Any,
    extra: dict[str, Any],
    keep: int,
) -> Path:
    root = ckpt_root(out)
    final = root / f"step-{step:07d}"
    tmp = root / f"step-{step:07d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_drafter(tmp, net.cfg, net.state_dict(), "float32")
    state = {
        "step": step,
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "torch_rng": torch.get_rng_state(),
        **extra,  # the training config, the data split
    }
    torch.save(state, tmp / TRAINER_STATE)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in list_checkpoints(out)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(
    path: Path, net: DrafterNetwork, opt: torch.optim.Optimizer, sched: Any
) -> dict[str, Any]:
    """Restore weights, optimizer, scheduler and RNG from ``path``; returns ``trainer.pt``.

    ``net`` must have been built with the checkpoint's config and ``d2t``
    (``saved_drafter``), so its installed target head already matches.
    """
    _, weights = load_drafter_weights(path)
    if not torch.equal(weights["d2t"], net.d2t):
        raise ValueError(f"{path}: the network was built with another draft vocabulary")
    net.load_state_dict(weights)
    state = trainer_state(path)
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    return state


def trainer_state(path: Path) -> dict[str, Any]:
    return torch.load(path / TRAINER_STATE, weights_only=False)


def saved_drafter(path: str | Path) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """A drafter folder's config and weights (``d2t`` among them)."""
    return load_drafter_weights(path)
