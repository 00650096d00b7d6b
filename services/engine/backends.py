"""Build an engine from user options: the target (in-process or TP over Ray) and the drafter."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from services.engine.core import Engine, EngineConfig
from services.engine.tokenizer import Tokenizer
from target_actor.checkpoint import resolve_target
from target_actor.config import ModelConfig
from target_actor.runner import TargetSpec

log = logging.getLogger("longspark.backends")

SHIPPED_DRAFTERS = Path(__file__).resolve().parents[2] / "drafter_actor" / "weights"


@dataclass
class EngineOptions:
    target: str | None = None  # local HF folder; None = the default model
    tp: int = 1
    dtype: str = "float32"
    mode: str = "spec"  # "spec" | "ar"
    drafter: str | None = None  # folder, "random", or None = the shipped one for the target
    k: int | None = None
    adaptive: bool = True  # per-round k from measured acceptance and cost (False: always k)
    carry: bool = True
    context_copy: bool = True  # False: never copy from context, even if the drafter would
    backend: str = "local"  # "local" | "ray"
    max_num_seqs: int = 32
    kv_cache_tokens: int = 65536
    seed: int = 0


def shipped_drafter(target_path: Path) -> Path | None:
    """The committed drafter trained for this target, if there is one."""
    candidate = SHIPPED_DRAFTERS / target_path.name
    return candidate if (candidate / "config.json").is_file() else None


def _ensure_ray(num_cpus: int) -> None:
    import ray

    if not ray.is_initialized():
        ray.init(
            num_cpus=max(os.cpu_count() or 1, num_cpus),
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )


def build_engine(opts: EngineOptions) -> tuple[Engine, Callable[[], None]]:
    """An engine and the function that shuts its actors down."""
    from drafter_actor.worker import LocalDrafter, RayDrafter
    from target_actor.worker import LocalTarget, TargetGroup

    path = resolve_target(opts.target)
    ModelConfig.from_pretrained(path).check_tp(opts.tp)
    spec = TargetSpec(str(path), dtype=opts.dtype, kv_cache_tokens=opts.kv_cache_tokens)
    drafter_path: str | None = None
    if opts.mode == "spec":
        shipped = shipped_drafter(path)
        drafter_path = opts.drafter or (str(shipped) if shipped else "random")
        if drafter_path == "random":
            log.info(
                "no trained drafter for %s: drafting with a random one (output stays exact)",
                path.name,
            )
    use_ray = opts.backend == "ray" or opts.tp > 1
    if use_ray:
        _ensure_ray(opts.tp + 2)
    closers: list[Callable[[], None]] = []
    drafter = None
    if drafter_path is not None:
        kw = dict(
            k=opts.k,
            carry=None if opts.carry else False,
            context_copy=None if opts.context_copy else False,
            seed=opts.seed,
        )
        drafter = (RayDrafter if use_ray else LocalDrafter)(str(path), drafter_path, **kw)
        closers.append(drafter.shutdown)
    window = drafter.window if drafter is not None else 256
    if drafter is not None:  # the target taps exactly the layers the drafter was built for
        spec = dataclasses.replace(spec, tap_layer_ids=tuple(drafter.cfg.tap_layer_ids))
    target = TargetGroup(spec, opts.tp, window=window) if use_ray else LocalTarget(spec, window)
    closers.append(target.shutdown)
    k = opts.k or (drafter.k if drafter is not None else 15)
    engine = Engine(
        target,
        Tokenizer(path),
        drafter,
        EngineConfig(
            k=k,
            max_num_seqs=opts.max_num_seqs,
            drafter_name=drafter_path or "",
            adaptive=opts.adaptive,
            copy_drafts=opts.context_copy,
        ),
    )

    def close() -> None:
        for fn in reversed(closers):
            fn()

    return engine, close
