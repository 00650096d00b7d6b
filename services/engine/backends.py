"""Build an engine from user options: the target (in-process or TP over Ray) and the drafter."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from services.engine.core import Engine, EngineConfig
from services.engine.tokenizer import Tokenizer
from target_actor.checkpoint import resolve_target
from target_actor.config import ModelConfig
from target_actor.runner import TargetSpec
from target_actor.weight_choice import check_form_names, check_kv_dtype

log = logging.getLogger("longspark.backends")

DEFAULT_WINDOW = 256  # the target verifier's default drafter window
SHIPPED_DRAFTERS = Path(__file__).resolve().parents[2] / "drafter_actor" / "weights"


class EngineOptions(BaseModel):
    """The engine's settings, defined once: the CLI and the benchmarks build one, and the
    serving config (``services.serving.config.ServeArgs``) embeds these fields as they are."""

    model_config = ConfigDict(extra="forbid")

    target: str | None = Field(
        None, description="local Hugging Face folder; None = the default model (fetched once)"
    )
    tp: int = Field(1, ge=1, description="tensor-parallel degree: target ranks")
    dtype: str = Field(
        "auto", description="target activations / KV / dense weights: auto, float32, bfloat16"
    )
    quant: str = Field("auto", description="target GEMM weights: auto, none, int8, int4")
    kv_dtype: str = Field(
        "auto", description="the target's KV cache: auto (as dtype), float32, bfloat16"
    )
    mode: Literal["spec", "ar"] = Field("spec", description="speculative or plain decoding")
    drafter: str | None = Field(
        None,
        description="drafter folder or 'random'; None = the shipped drafter for the target",
    )
    k: int | None = Field(None, ge=1, description="draft tokens per round (default: drafter's)")
    adaptive: bool = Field(
        True, description="pick each round's k from measured acceptance and cost (0 = plain)"
    )
    carry: bool = Field(True, description="Carryover of rejected positions (ablation switch)")
    context_copy: bool = Field(
        True, description="copy recent n-gram continuations (drafter and engine; ablation)"
    )
    max_num_seqs: int = Field(32, ge=1, description="running sequences at once")
    kv_cache_tokens: int = Field(65536, ge=16, description="KV-cache token budget")
    seed: int = Field(0, description="seed of the drafter's sampler for unseeded requests")

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, v: str) -> str:
        check_form_names(v, "auto")
        return v

    @field_validator("quant")
    @classmethod
    def _known_quant(cls, v: str) -> str:
        check_form_names("auto", v)
        return v

    @field_validator("kv_dtype")
    @classmethod
    def _known_kv_dtype(cls, v: str) -> str:
        check_kv_dtype(v)
        return v

    def target_spec(self, **extra: Any) -> TargetSpec:
        return TargetSpec(
            str(self.target),
            dtype=self.dtype,
            quant=self.quant,
            kv_dtype=self.kv_dtype,
            kv_cache_tokens=self.kv_cache_tokens,
            **extra,
        )

    def drafter_kwargs(self) -> dict[str, Any]:
        """What the drafter handles take besides the folders (None = the checkpoint's)."""
        return dict(
            k=self.k,
            carry=None if self.carry else False,
            context_copy=None if self.context_copy else False,
            seed=self.seed,
        )

    def engine_config(self, drafter: Any | None, spec: TargetSpec | None = None) -> EngineConfig:
        """``spec``: the resolved target spec (its weight form sets ``any_k``)."""
        return EngineConfig(
            k=self.k or (drafter.k if drafter is not None else EngineConfig.k),
            max_num_seqs=self.max_num_seqs,
            drafter_name=(self.drafter or "") if self.mode == "spec" else "",
            adaptive=self.adaptive,
            copy_drafts=self.context_copy,
            any_k=spec is not None and not mkl_packed(spec),
        )


def mkl_packed(spec: TargetSpec) -> bool:
    """Whether the target's GEMMs are fp32 with MKL packs for verify row counts."""
    return spec.quant == "none" and spec.dtype in ("float32", "fp32") and bool(spec.packed_rows)


def views_window(drafter: Any | None) -> int:
    """Recent K/V rows the target ships the drafter (its window; unused without one)."""
    return drafter.window if drafter is not None else DEFAULT_WINDOW


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


def build_engine(opts: EngineOptions, backend: str = "local") -> tuple[Engine, Callable[[], None]]:
    """An engine and the function that shuts its actors down. ``backend`` "ray" runs the
    target ranks and the drafter as Ray actors (implied by ``tp > 1``)."""
    from drafter_actor.worker import LocalDrafter, RayDrafter
    from target_actor.worker import LocalTarget, TargetGroup

    path = resolve_target(opts.target)
    ModelConfig.from_pretrained(path).check_tp(opts.tp)
    opts = opts.model_copy(update={"target": str(path)})
    if opts.mode == "spec" and opts.drafter is None:
        shipped = shipped_drafter(path)
        opts = opts.model_copy(update={"drafter": str(shipped) if shipped else "random"})
        if shipped is None:
            log.info(
                "no trained drafter for %s: drafting with a random one (output stays exact)",
                path.name,
            )
    use_ray = backend == "ray" or opts.tp > 1
    if use_ray:
        _ensure_ray(opts.tp + 2)
    closers: list[Callable[[], None]] = []
    spec, drafter = opts.target_spec().resolved(opts.tp), None
    if opts.mode == "spec":
        cls = RayDrafter if use_ray else LocalDrafter
        drafter = cls(opts.target, opts.drafter, **opts.drafter_kwargs())
        closers.append(drafter.shutdown)
        # the target taps exactly the layers the drafter was built for
        spec = dataclasses.replace(spec, tap_layer_ids=tuple(drafter.cfg.tap_layer_ids))
    window = views_window(drafter)
    target = TargetGroup(spec, opts.tp, window=window) if use_ray else LocalTarget(spec, window)
    closers.append(target.shutdown)
    engine = Engine(target, Tokenizer(path), drafter, opts.engine_config(drafter, spec))

    def close() -> None:
        for fn in reversed(closers):
            fn()

    return engine, close
