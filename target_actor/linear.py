"""GEMM weights in the form the CPU rewards: dense (fp32 / bf16) or weight-only int8 / int4.

A decode step at small batch is memory-bound: its time is the bytes of weights it streams.
So besides dense weights we keep two weight-only quantized forms:

- ``int4``: groups of 32 weights along the input dim, the GGUF Q4_1 block ``w = d * q + m``
  with ``q`` in 0..15: a checkpoint dequantised from a Q4_1 file is re-quantised exactly.
- ``int8``: with ``csrc/q4.c``, GGUF Q8_0 blocks (``w = d * q`` per 32 inputs); otherwise
  one symmetric scale per output channel. Under int4 the LM head is int8 (a GGUF keeps its
  embedding / output above 4 bits; SmolLM2's is Q8_0, so it too is multiplied exactly).

With the C kernels built on a CPU with AVX512-VNNI, ``csrc/q4.c`` multiplies both by
integer dot products with fp16 ``d`` (and ``m``), fp32 activations split per block of 32
into two int8 planes (relative error ~3e-5, below bf16's): an extra row of a verify block
or a decode batch costs about half what it does in fp32 multiply-adds. Otherwise torch's
``_weight_int4pack_mm_for_cpu`` (bf16 activations and scales) and, for int8,
``csrc/gemm.c`` or ``_weight_int8pack_mm``.

All kernels compute every row independently of the others (checked in the tests), so a
sequence's logits do not depend on what it is batched with, as with dense GEMMs.

Dense fp32 weights can also be MKL-packed for chosen row counts M (a verify block's k+1):
``F.linear`` re-packs the weight on every call, which for a few rows costs as much as the
math. A pack is exact only for its own M, so other shapes take ``F.linear``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from target_actor import native

QUANTS = ("none", "int8", "int4", "int8-q8", "int4-q8")
EXACT_QUANTS = ("none", "int8", "int4")  # what ``auto`` may pick (see WeightForm.planes)
INT4_GROUP = 32


def mkl_packing_available() -> bool:
    return (
        torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_linear")
        and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
    )


def quant_kernels_available() -> bool:
    return hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(torch, "_weight_int8pack_mm")


@dataclass(frozen=True)
class WeightForm:
    """How a model's GEMM weights are stored and run (the same for every linear)."""

    quant: str = "none"  # one of QUANTS
    packed_rows: tuple[int, ...] = ()  # dense fp32 only: row counts MKL pre-packs

    def __post_init__(self) -> None:
        if self.quant not in QUANTS:
            raise ValueError(
                f"unknown quantization {self.quant!r}; choose from {', '.join(QUANTS)}"
            )

    @property
    def bits(self) -> str:
        """The weights' form without the activations': "none" | "int8" | "int4"."""
        return self.quant.removesuffix("-q8")

    @property
    def planes(self) -> int:
        """How the integer kernels take the activations: 2 int8 planes (to ~3e-5, the
        exact forms) or, for the ``-q8`` forms, 1 (llama.cpp's Q8 arithmetic on the same
        blocks: roughly half the GEMM work at several rows, and its rounding)."""
        return 1 if self.quant.endswith("-q8") else 2

    def head(self) -> WeightForm:
        """The LM head's form. Under int4 it is int8: a GGUF keeps its output / embedding
        matrix above 4 bits (SmolLM2's Q4_1 file does), and int4 would cost it ~10% error."""
        if self.bits == "int4":
            return WeightForm(self.quant.replace("int4", "int8"), self.packed_rows)
        return self

    def make(self, weight: torch.Tensor) -> Linear:
        """The linear for ``weight`` ``[out, in]`` (given in the model's dtype, or fp32)."""
        if self.bits == "int4" and weight.shape[1] % INT4_GROUP == 0:
            return Int4Linear(weight, self.planes)
        if self.bits in ("int4", "int8"):  # int4 on a shape it cannot group: int8
            return Int8Linear(weight, self.planes)
        return DenseLinear(weight, self.packed_rows)


class Linear:
    """``y = x @ W.T + b`` for ``x`` ``[M, in]``; the output has ``x``'s dtype (fp32 from the
    C kernels)."""

    act: torch.dtype | None = None  # the input dtype it takes (None: the model's)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Bytes a forward streams for this weight."""
        raise NotImplementedError


class DenseLinear(Linear):
    """A dense weight, plus MKL packs for selected row counts when it is fp32."""

    def __init__(self, weight: torch.Tensor, row_counts: tuple[int, ...] = ()) -> None:
        self.weight = weight
        self.packs: dict[int, torch.Tensor] = {}
        cpu = weight.device.type == "cpu"
        if row_counts and cpu and weight.dtype == torch.float32 and mkl_packing_available():
            self.weight = w = weight.contiguous()
            self.packs = {m: torch.ops.mkl._mkl_reorder_linear_weight(w, m) for m in row_counts}

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        pack = self.packs.get(x.shape[0]) if x.dim() == 2 else None
        if pack is None:
            return F.linear(x, self.weight, bias)
        return torch.ops.mkl._mkl_linear(x.contiguous(), pack, self.weight, bias, x.shape[0])

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class WeightOnly(Linear):
    """Quantized weight, bf16 activations. torch's kernels answer in bf16, cast back to the
    input's dtype; the C ones (``lib``) answer in fp32, kept as it is."""

    act = torch.bfloat16
    lib = None

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = self._run(x.to(self.act).contiguous())
        if self.lib is None and y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if bias is None else y + bias

    def dequantized(self) -> torch.Tensor:
        """The weight this linear multiplies by, ``[out, in]`` fp32 (for tests and reports)."""
        eye = torch.eye(self.in_features, dtype=self.act, device="cpu")
        return self._run(eye).float().t().contiguous()


def quantize_q4_1(weight: torch.Tensor, group: int = INT4_GROUP):
    """Asymmetric min/max int4 per group of ``group`` inputs (GGUF Q4_1's rule).

    Returns ``q`` ``[out, in]`` int32 in 0..15 and ``d``, ``m`` ``[out, in/group]`` fp32
    with ``w ~= d * q + m``. A weight whose groups already sit on such a grid (a
    dequantised Q4_1 checkpoint) comes back exactly.
    """
    w = weight.float().reshape(weight.shape[0], -1, group)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    d = (hi - lo) / 15
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = ((w - lo) / safe).round().clamp_(0, 15)
    q = torch.where(d > 0, q, torch.zeros_like(q))
    return q.reshape(weight.shape).to(torch.int32), d.squeeze(-1), lo.squeeze(-1)


def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP):
    """:func:`quantize_q4_1` in torch's int4 kernel's terms: ``q`` and ``scale``, ``zero``
    with ``w ~= (q - 8) * scale + zero``."""
    q, d, m = quantize_q4_1(weight, group)
    return q, d, m + 8 * d


def quantize_q8_0(weight: torch.Tensor, group: int = INT4_GROUP):
    """Symmetric int8 per group of ``group`` inputs (GGUF Q8_0's rule): ``q`` ``[out, in]``
    int8 and ``d`` ``[out, in/group]`` (fp16 values, in fp32) with ``w ~= d * q``."""
    w = weight.float().reshape(weight.shape[0], -1, group)
    d = (w.abs().amax(-1) / 127).half().float()
    safe = torch.where(d > 0, d, torch.ones_like(d)).unsqueeze(-1)
    q = (w / safe).round().clamp_(-127, 127).to(torch.int8)
    return q.reshape(weight.shape), d


def pack_q4(q: torch.Tensor) -> torch.Tensor:
    """``q`` ``[N, K]`` in 0..15 -> ``csrc/q4.c``'s tiles: for each 16 channels and 8 inputs
    64 bytes, byte ``4c + t`` = ``q[c, t]`` (low nibble) | ``q[c, 4 + t]`` (high nibble)."""
    N, K = q.shape
    t = q.to(torch.uint8).view(N // 16, 16, K // 8, 2, 4).permute(0, 2, 1, 4, 3)
    return (t[..., 0] | (t[..., 1] << 4)).contiguous().view(-1)


def pack_w8(q: torch.Tensor) -> torch.Tensor:
    """int8 ``q`` ``[N, K]`` -> ``csrc/q4.c``'s Q8_0 tiles: for each 16 channels and 4 inputs
    64 bytes, byte ``4c + t`` = ``q[c, t] + 128`` (unsigned, as ``vpdpbusd`` takes it)."""
    N, K = q.shape
    t = (q.to(torch.int16) + 128).to(torch.uint8).view(N // 16, 16, K // 4, 4).transpose(1, 2)
    return t.contiguous().view(-1)


def _tile_scales(s: torch.Tensor) -> torch.Tensor:
    """``[N, K/32]`` -> ``[N/16, K/32, 16]`` (the order ``csrc/q4.c`` reads them in)."""
    return s.reshape(s.shape[0] // 16, 16, -1).transpose(1, 2).contiguous()


class Int4Linear(WeightOnly):
    """GGUF Q4_1 blocks. With ``csrc/q4.c`` (VNNI) by integer dot products, fp32
    activations as ``planes`` int8 planes (see ``Int8Linear``); otherwise torch's int4
    kernel (bf16 activations)."""

    def __init__(self, weight: torch.Tensor, planes: int = 2) -> None:
        self.planes = _planes(planes)
        self.out_features, self.in_features = weight.shape
        q, d, m = quantize_q4_1(weight)
        self.lib = native_q4_lib(weight.shape)
        if self.lib is not None:  # csrc/q4.c: fp32 in, fp16 d and m (GGUF's), integer dots
            self.act = torch.float32
            self.packed = pack_q4(q)
            self.d, self.m = _tile_scales(d).half(), _tile_scales(m).half()
            return
        self.packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        # the kernel wants [in/group, out, 2] in the activation dtype
        zero = m + 8 * d
        self.scales_zeros = torch.stack([d, zero], -1).transpose(0, 1).to(self.act).contiguous()

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        if self.lib is not None:
            fn, n = self.lib.ls_gemm_q4, self.out_features
            return _int_gemm(fn, x, n, self.planes, self.packed, self.d, self.m)
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, INT4_GROUP, self.scales_zeros)

    @property
    def nbytes(self) -> int:
        if self.lib is not None:
            return self.packed.numel() + (self.d.numel() + self.m.numel()) * 2
        return self.packed.numel() + self.scales_zeros.numel() * 2


class Int8Linear(WeightOnly):
    """int8 weights. With ``csrc/q4.c`` (VNNI): GGUF Q8_0 blocks (an fp16 scale per 32
    inputs; the grid of a dequantised Q8_0 tensor, like SmolLM2's embedding, comes back
    exactly) by integer dot products, fp32 activations. Otherwise one scale per channel,
    by ``csrc/gemm.c`` (bf16 activations) or torch's ``_weight_int8pack_mm``.

    ``planes``: how finely the VNNI path takes the activations (``csrc/q4.c``): 2 (to ~3e-5
    of a block's largest value, the target's) or 1 (llama.cpp's Q8, half the integer work;
    for the drafter, whose rounding only shapes its proposals)."""

    def __init__(self, weight: torch.Tensor, planes: int = 2) -> None:
        self.planes = _planes(planes)
        w = weight.float()
        self.out_features, self.in_features = w.shape
        self.int_lib = native_q4_lib(weight.shape)
        if self.int_lib is not None:
            q, d = quantize_q8_0(w)
            self.act, self.lib = torch.float32, self.int_lib
            self.tiles, self.d = pack_w8(q), _tile_scales(d).half()
            return
        amax = w.abs().amax(1, keepdim=True)
        scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
        self.q = (w / scale).round().clamp_(-127, 127).to(torch.int8).contiguous()
        self.lib = native_gemm_lib(weight.shape)
        # the C kernel applies the fp32 scale to each sum; torch's takes it in bf16
        self.scale = scale.squeeze(1) if self.lib is not None else scale.squeeze(1).to(self.act)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        if self.int_lib is not None:
            fn = self.int_lib.ls_gemm_w8
            return _int_gemm(fn, x, self.out_features, self.planes, self.tiles, self.d)
        if self.lib is not None:
            return native_gemm(self.lib, native.GEMM_INT8, x, self.q, self.scale)
        return torch._weight_int8pack_mm(x, self.q, self.scale)

    @property
    def nbytes(self) -> int:
        if self.int_lib is not None:
            return self.tiles.numel() + self.d.numel() * 2
        return self.q.numel() + self.scale.numel() * self.scale.element_size()


def rows_through(lin: Linear, x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., in]`` through a linear that takes ``[M, in]`` rows: fp32 in (the
    C integer kernels' input), ``[..., out]`` back."""
    rows = x.reshape(-1, x.shape[-1]).float().contiguous()
    return lin(rows).view(*x.shape[:-1], -1)


def inference_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)``, by the C GEMM when ``weight`` is bf16 and nothing needs
    gradients: torch's bf16 matmul costs tens of microseconds a call at a few rows (the
    drafter's case). Same dtype out as in."""
    lib = None
    grads = torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad)
    if weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and not grads:
        lib = native_gemm_lib(weight.shape)
    if lib is None or x.numel() == 0:
        return F.linear(x.to(weight.dtype), weight).to(x.dtype)
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
    y = native_gemm(lib, native.GEMM_BF16, rows, weight.contiguous())
    return y.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def _planes(planes: int) -> int:
    """The activation planes of an integer GEMM (``csrc/q4.c``): 1 or 2."""
    if planes not in (1, 2):
        raise ValueError(f"planes must be 1 or 2, not {planes}")
    return planes


def _int_gemm(fn, x: torch.Tensor, n: int, planes: int, *weights: torch.Tensor) -> torch.Tensor:
    """``x`` ``[M, K]`` fp32 contiguous through one of ``csrc/q4.c``'s GEMMs (``fn``, with
    its activation ``planes`` and packed weight tensors) -> ``[M, n]`` fp32."""
    M, K = x.shape
    y = torch.empty(M, n, device="cpu")  # the C kernels: host memory only
    if fn(x.data_ptr(), M, K, *(w.data_ptr() for w in weights), n, y.data_ptr(), planes) != 0:
        raise MemoryError("native integer GEMM: out of memory")
    return y


def native_q4_lib(shape: tuple[int, int]):
    """The C integer GEMMs (``csrc/q4.c``) when built with VNNI and ``[out, in]`` fits
    them, else None. ``LONGSPARK_Q4=0`` keeps the other kernels (for comparisons)."""
    lib = native.library() if os.environ.get("LONGSPARK_Q4", "1") != "0" else None
    out_f, in_f = shape
    fits = out_f % native.Q4_CHANNELS == 0 and in_f % native.Q4_BLOCK == 0
    return lib if lib is not None and fits and lib.ls_gemm_q4_vnni() else None


def native_gemm_lib(shape: tuple[int, int]):
    """The C GEMMs (``csrc/gemm.c``) when built and ``[out, in]`` fits them, else None."""
    lib = native.library()
    out_f, in_f = shape
    fits = out_f % native.GEMM_CHANNELS == 0 and in_f % native.GEMM_STEP == 0
    return lib if lib is not None and fits else None


def native_gemm(lib, kind: int, x: torch.Tensor, weight: torch.Tensor, scale=None) -> torch.Tensor:
    """``x`` ``[M, in]`` bf16 contiguous times ``weight`` ``[out, in]`` (int8 with ``scale``
    ``[out]`` fp32, or bf16) transposed -> ``[M, out]`` fp32, by ``csrc/gemm.c``."""
    M, K = x.shape
    y = torch.empty(M, weight.shape[0], device="cpu")  # the C kernels: host memory only
    rc = lib.ls_gemm(
        kind,
        x.data_ptr(),
        M,
        K,
        weight.data_ptr(),
        None if scale is None else scale.data_ptr(),
        weight.shape[0],
        y.data_ptr(),
    )
    if rc != 0:
        raise MemoryError("native GEMM: out of memory")
    return y
