"""Pick the weight form (``--dtype`` / ``--quant`` ``auto``) by timing this CPU.

The machines this runs on differ: some have native bf16 (AVX512-BF16 / AMX), some do not,
and the quantized kernels' speed follows. So ``auto`` is not a table of CPU flags but a
measurement: a few model-shaped GEMMs at 1 and 8 rows (a decode step, a verify block),
big enough to stream from memory as a real step does, in each candidate form; the fastest
wins. It takes about a second, once per machine: the choice is saved under
``$LONGSPARK_HOME/weight_forms.json``, keyed by CPU model, core count, torch version and
shape, so every process on a machine (replicas, ranks, tests) makes the same choice.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from dataclasses import dataclass

import torch

from target_actor import native
from target_actor.linear import (
    EXACT_QUANTS,
    INT4_GROUP,
    QUANTS,
    WeightForm,
    native_q4_lib,
    quant_kernels_available,
    quantize_q4_1,
)
from target_actor.weights import CheckpointReader

log = logging.getLogger("longspark.target")

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
PROBE_BYTES = 96 << 20  # fp32 bytes of probe weights: well past any cache


@dataclass(frozen=True)
class Choice:
    dtype: torch.dtype  # activations, KV cache, dense weights
    quant: str  # GEMM weights: one of QUANTS
    timings_ms: dict[str, float]  # what the probe measured (empty when nothing was auto)


def _time(fn, reps: int = 3) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def probe(shape: tuple[int, int], candidates: list[tuple[torch.dtype, str]]) -> dict[str, float]:
    """Milliseconds for 1 + 8 rows through ``PROBE_BYTES`` of ``shape`` weights, per form."""
    out_f, in_f = shape
    copies = max(2, PROBE_BYTES // (out_f * in_f * 4))
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(out_f, in_f, generator=gen) * 0.02 for _ in range(copies)]
    result: dict[str, float] = {}
    for dtype, quant in candidates:
        form = WeightForm(quant)
        lins = [form.make(w.to(dtype) if quant == "none" else w) for w in weights]
        xs = [torch.randn(m, in_f, generator=gen).to(dtype) for m in (1, 8)]
        result[f"{quant}/{str(dtype).removeprefix('torch.')}"] = 1e3 * sum(
            _time(lambda x=x, lins=lins: [lin(x) for lin in lins]) for x in xs
        )
    return result


def holds_q4_1_weights(path: str) -> bool:
    """Whether the checkpoint's layer weights sit exactly on GGUF Q4_1 grids (a model
    dequantised from a Q4_1 file, like the default one), checked on its first layer's
    projections, and this host multiplies int4 by the C kernels (whose fp32 activations keep
    those weights' products exact to ~3e-5; torch's int4 kernel rounds them to bf16)."""
    names = [f"model.layers.0.{n}.weight" for n in ("self_attn.q_proj", "mlp.down_proj")]
    reader = CheckpointReader(path)
    try:
        weights = [reader.get(n) for n in names if reader.has(n)]
    finally:
        reader.close()
    if not weights:
        return False
    for w in weights:
        if w.dim() != 2 or w.shape[1] % INT4_GROUP or native_q4_lib(tuple(w.shape)) is None:
            return False
        q, d, m = quantize_q4_1(w)
        back = d.repeat_interleave(INT4_GROUP, 1) * q + m.repeat_interleave(INT4_GROUP, 1)
        if not torch.equal(back, w.float()):
            return False
    return True


def check_form_names(dtype: str, quant: str) -> None:
    """One-line ``ValueError`` for a ``--dtype`` / ``--quant`` name that is neither ``auto``
    nor known (the one check behind the CLI, the serving config and ``TargetSpec``)."""
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from auto, {', '.join(DTYPES)}")
    if quant != "auto" and quant not in QUANTS:
        raise ValueError(f"unknown quantization {quant!r}; choose from auto, {', '.join(QUANTS)}")


KV_DTYPES = ("auto", "float32", "bfloat16")


def check_quant_device(quant: str, device: str) -> None:
    """One-line ``ValueError`` for a quantized form on a device other than the CPU (its
    kernels are host code)."""
    if quant not in ("none", "auto") and not device.startswith("cpu"):
        raise ValueError(
            f"--quant {quant} runs on the CPU kernels only; on {device} use --quant none"
        )


def check_kv_dtype(kv_dtype: str) -> None:
    """One-line ``ValueError`` for a ``--kv-dtype`` other than auto, float32, bfloat16."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"unknown KV cache dtype {kv_dtype!r}; choose from {', '.join(KV_DTYPES)}")


def choose(
    dtype: str, quant: str, shape: tuple[int, int], device: str = "cpu", q4_1_grid: bool = False
) -> Choice:
    """Resolve ``auto`` in ``dtype`` / ``quant`` by measurement (see the module doc); on a
    GPU without measuring: bf16 dense weights (its tensor cores' form). ``q4_1_grid``: the
    checkpoint holds a Q4_1 GGUF's own weights (``holds_q4_1_weights``), which int4
    multiplies by exactly where int8 would re-round them: faithful first, no timing.

    Raises ``ValueError`` (one line) for an unknown name or a form this torch lacks.
    """
    check_form_names(dtype, quant)
    check_quant_device(quant, device)
    if device != "cpu":
        return Choice(torch.bfloat16 if dtype == "auto" else DTYPES[dtype], "none", {})
    if quant not in ("none", "auto") and not quant_kernels_available():
        raise ValueError(f"this torch ({torch.__version__}) has no CPU {quant} weight kernels")
    if dtype != "auto" and quant != "auto":
        return Choice(DTYPES[dtype], quant, {})
    if quant == "auto" and q4_1_grid:
        return Choice(torch.float32 if dtype == "auto" else DTYPES[dtype], "int4", {})
    dtypes = [DTYPES[dtype]] if dtype != "auto" else [torch.float32, torch.bfloat16]
    quants = (
        [quant]
        if quant != "auto"
        else (list(EXACT_QUANTS) if quant_kernels_available() else ["none"])
    )
    # a quantized GEMM runs in bf16 whatever the model's dtype; fp32 around it keeps the
    # residual stream and the KV cache exact, so the dtype is only raced for dense weights
    candidates = [(d, "none") for d in dtypes if "none" in quants]
    candidates += [
        (dtypes[0] if dtype != "auto" else torch.float32, q) for q in quants if q != "none"
    ]
    key = _machine_key(dtype, quant, shape)
    saved = _load_saved().get(key)
    if saved is not None:
        q, d = saved["form"].split("/")
        return Choice(DTYPES[d], q, saved["timings_ms"])
    timings = probe(shape, candidates)
    best = min(timings, key=timings.get)
    _save(key, {"form": best, "timings_ms": {k: round(v, 3) for k, v in timings.items()}})
    q, d = best.split("/")
    log.info(
        "weight form %s chosen by timing: %s", best, {k: round(v, 2) for k, v in timings.items()}
    )
    return Choice(DTYPES[d], q, timings)


def _cache_file():
    from target_actor.checkpoint import longspark_home

    return longspark_home() / "weight_forms.json"


def _machine_key(dtype: str, quant: str, shape: tuple[int, int]) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu
            )
    except OSError:
        pass
    kernels = "C" if native.available() else "torch"  # the C GEMMs change the int8 form's speed
    return (
        f"{cpu}|{os.cpu_count()}|torch {torch.__version__}|{kernels}|{dtype}/{quant}"
        f"|{shape[0]}x{shape[1]}"
    )


def _load_saved() -> dict:
    try:
        return json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return {}


def _save(key: str, value: dict) -> None:
    """Best effort (a read-only home only costs the next process a probe); atomic rename."""
    path = _cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        saved = _load_saved()
        saved[key] = value
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(saved, indent=1))
        tmp.replace(path)
    except OSError as exc:
        log.debug("could not save the weight-form choice: %s", exc)
