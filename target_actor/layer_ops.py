"""The row-wise steps of a decoder layer, in C (``csrc/rowwise.c``) or in torch.

A decode step at small batch is a chain of tiny ops between the GEMMs: residual add,
RMSNorm, casts to the GEMMs' bf16 input, bias, q/k norm, RoPE, SiLU * up. In torch each
is a dispatch of a few microseconds and a 1-row step has ~50 of them per layer; the C
versions do each chain in one pass. Both backends compute every row on its own, so a
row's result never depends on its batch; they differ from each other in the last bits,
so a model uses one backend for all its forwards.

Shapes: the residual stream ``h`` is ``[T, hidden]`` in the model dtype and is updated in
place; ``act`` is the dtype the GEMMs take (bf16 for the quantized forms).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from target_actor import native
from target_actor.rope import apply_rope


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim; the C pass for fp32 without gradients (torch's fused CPU
    kernel costs ~45 us a call at a few rows, the drafter's and the final norm's case)."""
    lib = native.library()
    grads = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    cpu_fp32 = x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu"
    if lib is None or grads or not cpu_fp32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    n = x.shape[-1]
    rows = x.reshape(-1, n).contiguous()
    out = torch.empty_like(rows)
    w = weight.contiguous()
    lib.ls_add_rms_norm(
        rows.data_ptr(), None, 0, w.data_ptr(), eps, out.data_ptr(), 0, rows.shape[0], n
    )
    return out.view(x.shape)


class TorchOps:
    lib = None  # no C library: attention takes torch's SDPA too

    def add_rms_norm(self, h, y, weight, eps: float, act: torch.dtype) -> torch.Tensor:
        """``h += y`` (when ``y`` is given), then ``rms_norm(h) * weight`` in ``act``."""
        if y is not None:
            h.add_(y)
        return rms_norm(h, weight, eps).to(act)

    def qkv_rope(self, qkv, bias, q_norm, k_norm, eps, cos, sin, heads, kv_heads, hd):
        """The QKV GEMM's output -> q ``[T, heads, hd]``, k, v ``[T, kv_heads, hd]`` in the
        model dtype: bias, per-head q/k RMSNorm (Qwen3), RoPE on q and k."""
        T, dtype = qkv.shape[0], cos.dtype
        qkv = qkv.to(dtype) if bias is None else qkv.to(dtype) + bias
        q, k, v = qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
        q, k, v = q.view(T, heads, hd), k.view(T, kv_heads, hd), v.view(T, kv_heads, hd)
        if q_norm is not None:
            q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def silu_mul(self, gate_up: torch.Tensor, act: torch.dtype) -> torch.Tensor:
        gate, up = gate_up.chunk(2, -1)
        return (F.silu(gate) * up).to(act)


def _is_bf16(x: torch.Tensor) -> int:
    return int(x.dtype == torch.bfloat16)


class NativeOps:
    """The C backend (CPU only: its buffers are host memory): fp32 residual stream, fp32
    or bf16 GEMM activations."""

    def __init__(self, lib) -> None:
        self.lib = lib

    def add_rms_norm(self, h, y, weight, eps, act):
        rows, n = h.shape
        out = torch.empty(rows, n, dtype=act, device="cpu")
        y = None if y is None else y.contiguous()
        self.lib.ls_add_rms_norm(
            h.data_ptr(),
            None if y is None else y.data_ptr(),
            0 if y is None else _is_bf16(y),
            weight.data_ptr(),
            eps,
            out.data_ptr(),
            _is_bf16(out),
            rows,
            n,
        )
        return out

    def qkv_rope(self, qkv, bias, q_norm, k_norm, eps, cos, sin, heads, kv_heads, hd):
        T = qkv.shape[0]
        q = torch.empty(T, heads, hd, device="cpu")
        k, v = (
            torch.empty(T, kv_heads, hd, device="cpu"),
            torch.empty(T, kv_heads, hd, device="cpu"),
        )
        self.lib.ls_qkv_rope(
            qkv.data_ptr(),
            _is_bf16(qkv),
            qkv.stride(0),
            None if bias is None else bias.data_ptr(),
            None if q_norm is None else q_norm.data_ptr(),
            None if k_norm is None else k_norm.data_ptr(),
            eps,
            cos.data_ptr(),
            sin.data_ptr(),
            q.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            T,
            heads,
            kv_heads,
            hd,
        )
        return q, k, v

    def silu_mul(self, gate_up, act):
        rows, n = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, n, dtype=act, device="cpu")
        gate_up = gate_up.contiguous()
        self.lib.ls_silu_mul(
            gate_up.data_ptr(), _is_bf16(gate_up), out.data_ptr(), _is_bf16(out), rows, n
        )
        return out


def ops_for(
    dtype: torch.dtype, head_dim: int, device: torch.device | str = "cpu"
) -> TorchOps | NativeOps:
    """The C backend when it is built and fits (CPU, fp32 stream, head_dim a multiple of
    its vector width), else torch (every other device)."""
    lib = native.library() if torch.device(device).type == "cpu" else None
    if lib is not None and dtype == torch.float32 and head_dim % native.LANES == 0:
        return NativeOps(lib)
    return TorchOps()
