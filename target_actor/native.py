"""The target's C kernels (``target_actor/csrc``), built for this CPU on first use.

One shared library, compiled by the system C compiler with ``-O3 -march=native
-fopenmp`` into ``$LONGSPARK_HOME/kernels/`` and keyed by the source, the flags and
the CPU's feature flags, so each machine builds once (about a second) and every process
on it loads the same file. It links the libgomp torch already loaded, so the kernels
share torch's OpenMP threads instead of bringing a second pool to two cores.

Without a compiler, or with ``LONGSPARK_NATIVE=0``, ``library()`` is None and the model
runs the same steps as torch ops (``target_actor/layer_ops.py``): slower by Python and
dispatch overhead, with the same guarantees (spec equals plain) and different last bits.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

log = logging.getLogger("longspark.target")

HEADERS = ("common.h", "layer.h")
SOURCES = (
    *HEADERS,
    "attention.c",
    "rowwise.c",
    "gemm.c",
    "q4.c",
    "decoder.c",
    "draft.c",
    "sample.c",
)
# the kernels that return nothing (the others return 0, or -1 when out of memory)
VOID = {
    *("ls_add_rms_norm", "ls_qkv_rope", "ls_silu_mul", "ls_draft_context_rows"),
    *("ls_race", "ls_softmax", "ls_top_p"),
}
LANES = 16  # head_dim must be a multiple of the kernels' vector width (csrc LANES)
GEMM_CHANNELS = 4  # the GEMMs take out_features in multiples of this (csrc/gemm.c NB)
GEMM_STEP = 32  # ... and in_features in multiples of this (csrc/gemm.c STEP)
GEMM_INT8, GEMM_BF16 = 0, 1  # ls_gemm's weight kinds
Q4_CHANNELS, Q4_BLOCK = 16, 32  # ls_gemm_q4: out_features, in_features multiples (csrc/q4.c)
# -fno-trapping-math lets floorf (in exp) vectorise; nothing here reassociates floats.
# -mprefer-vector-width=512: GCC's loops vectorise 256 bits wide on Intel unless told; the
# element-wise loops (exp over a row's scores, the norms) then take half the instructions,
# with the same bits (no loop here reassociates).
CFLAGS = (
    "-O3",
    "-march=native",
    "-mprefer-vector-width=512",
    "-fno-trapping-math",
    "-fopenmp",
    "-fPIC",
    "-shared",
    "-std=c11",
)
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


def cpu_flags() -> str:
    """The CPU's feature flags (/proc/cpuinfo), space-separated; empty where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("flags")), "")
    except OSError:
        return ""


def _build(compiler: str, extra_flags: tuple[str, ...] = ()) -> Path:
    from target_actor.checkpoint import longspark_home

    flags = (*CFLAGS, *extra_flags)
    src_dir = Path(__file__).with_name("csrc")
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update((src_dir / name).read_bytes())
    digest.update(" ".join((compiler, *flags, cpu_flags())).encode())
    out = longspark_home() / "kernels" / f"longspark-{digest.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [
        compiler,
        *flags,
        "-o",
        tmp,
        *(str(src_dir / n) for n in SOURCES if n.endswith(".c")),
        "-lm",
    ]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
        os.replace(tmp, out)  # atomic: concurrent builders race harmlessly
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@cache
def library() -> ctypes.CDLL | None:
    """The kernels for this machine, or None (no compiler, a failed build, or disabled)."""
    if os.environ.get("LONGSPARK_NATIVE", "1") == "0":
        return None
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler: the target uses its slower torch attention path")
        return None
    try:
        return build_variant(compiler=compiler)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("C kernels unavailable (%s): using the torch attention path", detail)
        return None


def build_variant(extra_flags: tuple[str, ...] = (), compiler: str | None = None) -> ctypes.CDLL:
    """Build (or reuse) and load the kernels with ``extra_flags`` added, e.g.
    ``("-mno-avx512bf16",)`` for the path of a CPU without bf16 (tests)."""
    import torch  # noqa: F401  (loads torch's libgomp first, so the kernels share it)

    compiler = compiler or _compiler()
    if compiler is None:
        raise OSError("no C compiler")
    lib = ctypes.CDLL(str(_build(compiler, extra_flags)))
    i32, f32 = ctypes.c_int, ctypes.c_float
    # ls_decoder: layers, n, h, eps, T, hidden, cos, sin, heads, kv_heads, head_dim, scale,
    # then ls_attend's sequences, kv_bf16, nine scratch buffers, three tap pointer arrays
    decoder_args = [_PTR, _I64, _PTR, f32, _I64, _I64, _PTR, _PTR, i32, i32, i32, f32, _I64, *(_PTR,) * 5, i32, *(_PTR,) * 12]  # fmt: skip
    # ls_draft_pass: layers, n, h, eps, sequences, S, hidden, cos, sin, heads, kv_heads,
    # head_dim, scale, ls_draft_attend's context (ctx_k, ctx_v, mask, C, g, sum_m, sum_lam,
    # R), norm, LM head tiles, scales, vocab, planes, base logits
    draft_args = [_PTR, _I64, _PTR, f32, _I64, i32, _I64, _PTR, _PTR, i32, i32, i32, f32, *(_PTR,) * 3, i32, *(_PTR,) * 3, i32, *(_PTR,) * 3, _I64, i32, _PTR]  # fmt: skip
    signatures = {
        # q, k, v (+ row strides), out, sequences, base, cap, start, nnew, row0, layer,
        # heads, kv_heads, head_dim, scale
        "ls_attend": [*(_PTR, _I64) * 3, _PTR, _I64, *(_PTR,) * 5, _I64, i32, i32, i32, f32, i32],
        # q, kb, vb, ctx_k, ctx_v, ctx_mask, g, sum_m, sum_lam, out, n, layer, S, heads,
        # kv_heads, C, R, head_dim, scale (the drafter's layer attention)
        "ls_draft_attend": [*(_PTR,) * 10, _I64, _I64, *(i32,) * 6, f32],
        # h, y, y_bf16, w, eps, out, out_bf16, rows, n
        "ls_add_rms_norm": [_PTR, _PTR, i32, _PTR, f32, _PTR, i32, _I64, _I64],
        # ... kv_bf16 (the cache holds bf16)
        # qkv, bf16, stride, bias, q_norm, k_norm, eps, cos, sin, q, k, v, rows, heads,
        # kv_heads, head_dim
        "ls_qkv_rope": [_PTR, i32, _I64, *(_PTR,) * 3, f32, *(_PTR,) * 5, _I64, i32, i32, i32],
        # gate_up, bf16, out, out_bf16, rows, n
        "ls_silu_mul": [_PTR, i32, _PTR, i32, _I64, _I64],
        # kind (0 int8, 1 bf16), x, M, K, weights, scales, N, y
        "ls_gemm": [i32, _PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR],
        "ls_gemm_bf16_dot": [],
        # x, M, K, packed weights, d, m, N, y, activation planes (1 or 2)
        "ls_gemm_q4": [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _PTR, i32],
        # x, M, K, packed weights, scales, N, y, activation planes (1 or 2)
        "ls_gemm_w8": [_PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, i32],
        "ls_gemm_q4_vnni": [],
        # want the AMX tiles (1) or not (0) -> whether the GEMMs take them
        "ls_gemm_amx": [i32],
        "ls_decoder": decoder_args,
        "ls_draft_pass": draft_args,
        # rows, cos, sin, n, layers, kv_heads, head_dim, k / v buffer addresses, C, row
        "ls_draft_context_rows": [*(_PTR,) * 3, _I64, i32, i32, i32, _PTR, _PTR, i32, i32],
        # base, n, k, vocab, anchor, w1, rank, W2 tiles, scales, planes, tokens
        "ls_markov_greedy": [_PTR, _I64, i32, _I64, _PTR, _PTR, _I64, _PTR, _PTR, i32, _PTR],
        # weights, rows, vocab, keys, winners
        "ls_race": [_PTR, _I64, _I64, _PTR, _PTR],
        # x, rows, vocab, out
        "ls_softmax": [_PTR, _I64, _I64, _PTR],
        # p, rows, vocab, top_p, candidates at most, scratch, out, rows done
        "ls_top_p": [_PTR, _I64, _I64, f32, _I64, _PTR, _PTR, _PTR],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.restype = None if name in VOID else ctypes.c_int
        fn.argtypes = argtypes
    # AMX tiles for the integer GEMMs where the CPU and kernel have them (the same bits as
    # the VNNI path); LONGSPARK_AMX=0 keeps to VNNI
    lib.ls_gemm_amx(int(os.environ.get("LONGSPARK_AMX", "1") != "0"))
    return lib


def available() -> bool:
    return library() is not None
