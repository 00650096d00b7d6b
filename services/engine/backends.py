"""Build an engine from user options: the target (in-process or TP over Ray) and the drafter."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.engine.core import Engine, EngineConfig
from services.engine.tokenizer import Tokenizer
from target_actor.checkpoint import resolve_target
from target_actor.config import ModelConfig
from target_actor.errors import LongSparkError
from target_actor.runner import TargetSpec
from target_actor.weight_choice import check_form_names, check_kv_dtype

log = logging.getLogger("longspark.backends")

DEFAULT_WINDOW = 256  # the target verifier's default drafter window
SHIPPED_DRAFTERS = Path(__file__).resolve().parents[2] / "drafter_actor" / "weights"
TORCH_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


class DeviceError(LongSparkError, ValueError):
    """The settings ask for GPUs that this machine (or the running Ray) does not have."""


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
    quant: str = Field(
        "auto", description="target GEMM weights: auto, none, int8, int4, int8-q8, int4-q8"
    )
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

    # devices: every target rank on one GPU of its own (NCCL between ranks), the drafter on
    # its own GPU or a share of one; what crosses between them goes through host memory
    device: Literal["cpu", "cuda"] = Field(
        "cpu", description="the target's weights and KV cache, and the drafter: cpu or cuda"
    )
    drafter_device: str | None = Field(
        None,
        description="in-process engines only: the drafter's device if not the target's"
        " (e.g. cuda:1); over Ray the drafter reserves drafter_gpus of its own",
    )
    gpus_per_rank: float = Field(
        1.0,
        gt=0,
        le=1,
        description="over Ray with device cuda: the share of a GPU each target rank reserves"
        " (over 0.5 when tp > 1: NCCL needs every rank on a GPU of its own)",
    )
    drafter_gpus: float = Field(
        1.0,
        gt=0,
        le=1,
        description="over Ray with device cuda: the share of a GPU the drafter reserves"
        " (0.5, with gpus_per_rank 0.5, puts a TP=1 target and the drafter on one GPU)",
    )

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

    @field_validator("drafter_device")
    @classmethod
    def _known_device(cls, v: str | None) -> str | None:
        if v is not None and not TORCH_DEVICE.fullmatch(v):
            raise ValueError(f"expected cpu, cuda or cuda:N, got {v!r}")
        return v

    @model_validator(mode="after")
    def _ranks_apart(self) -> EngineOptions:
        if self.device == "cuda" and self.tp > 1 and self.gpus_per_rank <= 0.5:
            raise ValueError(
                f"gpus_per_rank {self.gpus_per_rank:g} at tp {self.tp} lets two ranks share a"
                " GPU, which NCCL refuses: give each rank over 0.5 (default 1)"
            )
        return self

    def target_spec(self, **extra: Any) -> TargetSpec:
        return TargetSpec(
            str(self.target),
            dtype=self.dtype,
            quant=self.quant,
            kv_dtype=self.kv_dtype,
            kv_cache_tokens=self.kv_cache_tokens,
            device=self.device,
            **extra,
        )

    def drafter_kwargs(self, ray: bool = False) -> dict[str, Any]:
        """What the drafter handles take besides the folders (None = the checkpoint's).
        ``ray``: for a Ray actor, whose "cuda" is the GPU Ray assigned it."""
        return dict(
            k=self.k,
            carry=None if self.carry else False,
            context_copy=None if self.context_copy else False,
            seed=self.seed,
            device=self.device if ray else self.drafter_device or self.device,
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


def visible_gpus() -> tuple[float, bool]:
    """GPUs one engine can use, and whether Ray counted them: the running Ray's largest
    live node (a replica's placement group is ``STRICT_PACK``, on one node), else this
    machine's CUDA devices (what a Ray started here will see)."""
    import ray
    import torch

    if ray.is_initialized():
        nodes = [n["Resources"].get("GPU", 0.0) for n in ray.nodes() if n.get("Alive")]
        return max(nodes, default=0.0), True
    return (torch.cuda.device_count() if torch.cuda.is_available() else 0), False


def check_devices(
    opts: EngineOptions, use_ray: bool, gpus: tuple[float, bool] | None = None
) -> None:
    """Fail in one line, before Ray or any actor starts, when ``opts`` asks for GPUs that
    are not there. ``use_ray``: target ranks and drafter as Ray actors (serving always);
    ``gpus``: ``visible_gpus()``'s answer (tests pass their own)."""
    if opts.device == "cpu" and opts.drafter_device in (None, "cpu"):
        return
    if opts.drafter_device is not None and use_ray:
        raise DeviceError(
            f"--drafter-device {opts.drafter_device}: in-process engines only; over Ray the"
            " drafter reserves drafter_gpus of a GPU of its own"
        )
    count, from_ray = visible_gpus() if gpus is None else gpus
    flag = (
        f"--device {opts.device}"
        if opts.device != "cpu"
        else f"--drafter-device {opts.drafter_device}"
    )
    if count == 0:
        why = "the running Ray has no GPU" if from_ray else "torch.cuda.is_available() is False"
        raise DeviceError(f"{flag}: no CUDA device is visible ({why})")
    where = "on one node of the running Ray" if from_ray else "visible"
    index = int(opts.drafter_device.partition(":")[2] or 0) if opts.drafter_device else 0
    if index >= count:
        raise DeviceError(f"--drafter-device {opts.drafter_device}: {count:g} GPU(s) {where}")
    if opts.device == "cpu" or not use_ray:
        return
    if opts.tp > count:
        raise DeviceError(
            f"--tp {opts.tp} needs {opts.tp} GPUs (one per rank, NCCL): {count:g} {where}"
        )
    drafter = opts.drafter_gpus if opts.mode == "spec" else 0.0
    need = opts.tp * opts.gpus_per_rank + drafter
    if need > count:
        raise DeviceError(
            f"tp {opts.tp} x gpus_per_rank {opts.gpus_per_rank:g} + drafter_gpus {drafter:g}"
            f" = {need:g} GPUs per engine: {count:g} {where} (ranks and the drafter can share"
            " GPUs: lower gpus_per_rank and drafter_gpus, e.g. 0.5 each at tp 1)"
        )


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
    check_devices(opts, use_ray)
    if use_ray:
        _ensure_ray(opts.tp + 2)
    closers: list[Callable[[], None]] = []
    spec, drafter = opts.target_spec().resolved(opts.tp), None
    gpus = opts.device == "cuda" and use_ray
    if opts.mode == "spec":
        if use_ray:
            drafter = RayDrafter(
                opts.target,
                opts.drafter,
                num_gpus=opts.drafter_gpus if gpus else 0.0,
                **opts.drafter_kwargs(ray=True),
            )
        else:
            drafter = LocalDrafter(opts.target, opts.drafter, **opts.drafter_kwargs())
        closers.append(drafter.shutdown)
        # the target taps exactly the layers the drafter was built for
        spec = dataclasses.replace(spec, tap_layer_ids=tuple(drafter.cfg.tap_layer_ids))
    window = views_window(drafter)
    if use_ray:
        rank_gpus = opts.gpus_per_rank if gpus else 0.0
        target = TargetGroup(spec, opts.tp, gpus_per_rank=rank_gpus, window=window)
    else:
        target = LocalTarget(spec, window)
    closers.append(target.shutdown)
    engine = Engine(target, Tokenizer(path), drafter, opts.engine_config(drafter, spec))

    def close() -> None:
        for fn in reversed(closers):
            fn()

    return engine, close
