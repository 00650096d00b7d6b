"""One rank's target: the model shard, its KV cache, and the calls the engine makes.

Used directly in-process at TP=1 and wrapped by the Ray actor ``TargetWorker`` for any
TP degree; every rank runs the same calls in the same order, so collectives line up.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from target_actor.batch import ForwardBatch, ForwardOutput
from target_actor.config import DEFAULT_NUM_TAPS, ModelConfig, TargetConfigError
from target_actor.kv_cache import KVCache, KVCacheFull
from target_actor.linear import WeightForm
from target_actor.model import TargetModel
from target_actor.parallel import TPContext
from target_actor.weight_choice import (
    DTYPES,
    check_form_names,
    check_kv_dtype,
    check_quant_device,
    choose,
    holds_q4_1_weights,
)
from target_actor.weights import CheckpointReader

log = logging.getLogger("longspark.target")


@dataclass(frozen=True)
class TargetSpec:
    """How to build a target rank (the same for every rank of a group)."""

    path: str
    dtype: str = "float32"  # activations, KV cache, dense weights; "auto": timed at start
    quant: str = "none"  # GEMM weights: one of linear.QUANTS, or auto (timed at start)
    kv_cache_tokens: int = 65536  # whole-model token budget of the KV pool
    num_taps: int = DEFAULT_NUM_TAPS
    tap_layer_ids: tuple[int, ...] | None = None  # the drafter's taps; default evenly spaced
    num_threads: int | None = None
    packed_rows: tuple[int, ...] = (8, 16)  # row counts whose GEMM weights MKL pre-packs
    kv_dtype: str = "auto"  # the KV cache: auto (= dtype), float32, bfloat16
    device: str = "cpu"  # cpu | cuda | cuda:N: weights, KV cache and every per-round tensor

    def __post_init__(self) -> None:
        try:
            check_form_names(self.dtype, self.quant)
            check_kv_dtype(self.kv_dtype)
            check_quant_device(self.quant, self.device)
        except ValueError as exc:
            raise TargetConfigError(str(exc)) from None
        if self.kv_cache_tokens < 16:
            raise TargetConfigError("kv_cache_tokens must be at least 16")

    def resolved(self, tp: int = 1) -> TargetSpec:
        """This spec with ``auto`` dtype / quant decided (by timing, once), so that every
        rank of a group builds the same form."""
        if "auto" not in (self.dtype, self.quant):
            return self
        cfg = ModelConfig.from_pretrained(self.path, self.num_taps)
        choice = _choose(self, _probe_shape(cfg, tp))
        name = str(choice.dtype).removeprefix("torch.")
        return dataclasses.replace(self, dtype=name, quant=choice.quant)


def _probe_shape(cfg: ModelConfig, tp: int) -> tuple[int, int]:
    return (2 * cfg.intermediate_size // tp, cfg.hidden_size)


def _choose(spec: TargetSpec, shape: tuple[int, int]):
    """``spec``'s form, ``auto`` resolved (a Q4_1 checkpoint's own grid first)."""
    grid = spec.quant == "auto" and holds_q4_1_weights(spec.path)
    try:
        return choose(spec.dtype, spec.quant, shape, torch.device(spec.device).type, grid)
    except ValueError as exc:
        raise TargetConfigError(str(exc)) from None


def resolve_device(name: str) -> torch.device:
    """``cpu``, ``cuda`` (this process's current GPU: the one Ray assigned an actor) or
    ``cuda:N``; a one-line error when CUDA is asked for and none is visible."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise TargetConfigError(f"unknown device {name!r}; use cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise TargetConfigError(f"unsupported device {name!r}; use cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise TargetConfigError(f"device {name}: no CUDA device is visible to this process")
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise TargetConfigError(
            f"device {name}: only {torch.cuda.device_count()} CUDA device(s) are visible"
        )
    return torch.device("cuda", index)


class TargetRunner:
    def __init__(self, spec: TargetSpec, tp: TPContext | None = None) -> None:
        self.spec, self.tp = spec, tp or TPContext()
        if spec.num_threads:
            torch.set_num_threads(spec.num_threads)
        self.cfg = ModelConfig.from_pretrained(spec.path, spec.num_taps)
        if spec.tap_layer_ids is not None:
            self.cfg = dataclasses.replace(self.cfg, tap_layer_ids=tuple(spec.tap_layer_ids))
        self.cfg.check_tp(self.tp.world)
        self.device = resolve_device(spec.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        shape = _probe_shape(self.cfg, self.tp.world)
        choice = _choose(spec, shape)
        dtype, self.quant, self.form_timings = choice.dtype, choice.quant, choice.timings_ms
        t0 = time.perf_counter()
        model = TargetModel(self.cfg, self.tp, dtype, self.device)
        # quantize from fp32 weights: a dequantised 4-bit checkpoint then comes back exactly
        ckpt = CheckpointReader(Path(spec.path), dtype if self.quant == "none" else torch.float32)
        model.load(ckpt)  # read on the host, one layer at a time, then moved whole
        ckpt.close()
        model.to(self.device)
        model.prepare(WeightForm(self.quant, tuple(spec.packed_rows)), dtype)
        self.model = model.eval()
        self.cache = KVCache(
            self.cfg.num_layers,
            model.local_kv_heads,
            self.cfg.head_dim,
            spec.kv_cache_tokens,
            dtype=dtype if spec.kv_dtype == "auto" else DTYPES[spec.kv_dtype],
            device=self.device,
        )
        self.dtype = dtype
        log.info(
            "rank %d/%d loaded %s (%s, weights %s, %s) in %.1fs",
            self.tp.rank,
            self.tp.world,
            spec.path,
            str(dtype).removeprefix("torch."),
            self.quant,
            self.device,
            time.perf_counter() - t0,
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """Roll each sequence back to ``start_pos``, append its new tokens, run the model."""
        for i, (seq_id, start, n) in enumerate(
            zip(batch.seq_ids, batch.start_pos, batch.num_new, strict=True)
        ):
            have = self.cache.length(seq_id)
            if start > have:
                raise ValueError(
                    f"sequence {seq_id}: start {start} is past its cache length {have}"
                )
            if start + n > self.cfg.max_position_embeddings:
                raise TargetConfigError(
                    f"sequence {seq_id} would reach {start + n} tokens, over the model's context "
                    f"of {self.cfg.max_position_embeddings}"
                )
            if seq_id in self.cache.seqs:
                self.cache.rollback(seq_id, start)
            if batch.capacity is None:
                self.cache.reserve(seq_id, start + n)
            elif start + n > batch.capacity[i]:
                raise ValueError(
                    f"sequence {seq_id} would reach {start + n} rows, past the "
                    f"{batch.capacity[i]} its scheduler granted"
                )
            else:
                self.cache.reserve(seq_id, batch.capacity[i], exact=True)
            self.cache.set_length(seq_id, start + n)
        return self.model(batch, self.cache)

    def fork(self, src: int, dst: int, capacity: int | None = None) -> None:
        """``dst``'s cache becomes a copy of ``src``'s (same prompt, prefilled once)."""
        self.cache.fork(src, dst, capacity)

    def free(self, seq_ids: list[int]) -> None:
        """Drop these sequences' KV caches (finished, or preempted to be recomputed)."""
        for seq_id in seq_ids:
            self.cache.free(seq_id)

    def kv_stats(self) -> dict[str, int]:
        return {
            "total_blocks": self.cache.total_blocks,
            "used_blocks": self.cache.used_blocks,
            "block_size": self.cache.block_size,
            "num_seqs": len(self.cache.seqs),
        }

    def config(self) -> ModelConfig:
        return self.cfg


__all__ = ["TargetRunner", "TargetSpec", "KVCacheFull"]
