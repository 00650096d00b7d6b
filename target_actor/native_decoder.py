"""The decoder's layers in one C call (``csrc/decoder.c``) for decode and verify forwards.

``TargetModel.forward`` runs a layer as ~10 calls from Python (norms, GEMMs, RoPE,
attention); for a small model on a CPU that Python is a large share of a decode step
(``docs/experiments/runtime-kernels.md``), and it holds the GIL between the calls. When
every GEMM is one of ``csrc/q4.c``'s integer kernels, TP is 1 and every sequence's rows
attend in the C kernel (no prompt chunk), the same kernels run in the same order from one
C loop instead, on the same buffers: the output is the same bits (a test compares them),
and the forward holds the GIL once.
"""

from __future__ import annotations

import ctypes

import torch

from target_actor.linear import Int4Linear, Int8Linear, Linear

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
KIND_Q4, KIND_W8 = 0, 1  # csrc/decoder.c


class LayerStruct(ctypes.Structure):
    """``ls_layer`` (``csrc/layer.h``): one layer's norms and GEMM weights by address."""

    _fields_ = [
        ("input_norm", _PTR),
        ("post_norm", _PTR),
        ("q_norm", _PTR),
        ("k_norm", _PTR),
        ("w", _PTR * 4),
        ("d", _PTR * 4),
        ("m", _PTR * 4),
        ("n", _I64 * 4),
        ("k", _I64 * 4),
        ("kind", _I64 * 4),
        ("planes", _I64 * 4),
    ]


def gemm_fields(lin: Linear) -> tuple[int, int, int, int | None, int, int, int] | None:
    """(kind, tiles, d, m, n, k, planes) of a linear on ``csrc/q4.c``'s kernels, or None."""
    if isinstance(lin, Int4Linear) and lin.lib is not None:
        w, d, m = lin.packed.data_ptr(), lin.d.data_ptr(), lin.m.data_ptr()
        return KIND_Q4, w, d, m, lin.out_features, lin.in_features, lin.planes
    if isinstance(lin, Int8Linear) and lin.int_lib is not None:
        w, d = lin.tiles.data_ptr(), lin.d.data_ptr()
        return KIND_W8, w, d, None, lin.out_features, lin.in_features, lin.planes
    return None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def fill_layer(entry: LayerStruct, norms: tuple, lins: tuple) -> bool:
    """Point ``entry`` at a layer's fp32 norms (input, post, q, k; None: absent) and its
    four linears (qkv, o, gate_up, down); False when one of them cannot go to C."""
    fields = [gemm_fields(lin) for lin in lins]
    if any(f is None for f in fields) or norms[0].dtype != torch.float32:
        return False
    entry.input_norm, entry.post_norm, entry.q_norm, entry.k_norm = (_ptr(t) for t in norms)
    for g, (kind, w, d, m, n, k, planes) in enumerate(fields):
        entry.kind[g], entry.w[g], entry.d[g], entry.m[g] = kind, w, d, m
        entry.n[g], entry.k[g], entry.planes[g] = n, k, planes
    return True


class NativeDecoder:
    """Every layer's weights as ``csrc/decoder.c`` reads them, or ``build`` says None when
    a layer cannot go there. Built after the weights are prepared; it points into them."""

    def __init__(self, lib, layers: ctypes.Array) -> None:
        self.fn, self.layers = lib.ls_decoder, layers

    @classmethod
    def build(cls, lib, model) -> NativeDecoder | None:
        if lib is None or model.tp.enabled:
            return None
        layers = (LayerStruct * len(model.layers))()
        for entry, layer in zip(layers, model.layers, strict=True):
            if layer.qkv_bias is not None or layer.o_bias is not None:
                return None
            norms = (layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm)
            lins = (layer.lin_qkv, layer.lin_o, layer.lin_gate_up, layer.lin_down)
            if not fill_layer(entry, norms, lins):
                return None
        return cls(lib, layers)

    def run(self, model, h, cos, sin, plan, taps: bool):
        """All layers on ``h`` ``[T, hidden]`` (updated in place, as the Python loop does);
        the last layer's output ``y`` and, with ``taps``, each tap layer's (h, k, v)."""
        cfg = model.cfg
        T, hidden, hd = h.shape[0], cfg.hidden_size, cfg.head_dim
        first = model.layers[0]
        heads, kv_heads, inter = first.heads, first.kv_heads, first.inter
        nq, nkv = heads * hd, kv_heads * hd

        def empty(*shape: int) -> torch.Tensor:
            return torch.empty(*shape, dtype=torch.float32, device="cpu")

        x, y, q, attn = empty(T, hidden), empty(T, hidden), empty(T, nq), empty(T, nq)
        qkv, k, v = empty(T, nq + 2 * nkv), empty(T, kv_heads, hd), empty(T, kv_heads, hd)
        gu, act = empty(T, 2 * inter), empty(T, inter)
        tap_out: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        tap_args: list[int | None] = [None, None, None]
        if taps:
            ptrs = [(_PTR * len(model.layers))() for _ in range(3)]
            for i in sorted(model.tap_index):
                tap = (empty(T, hidden), empty(T, kv_heads, hd), empty(T, kv_heads, hd))
                tap_out.append(tap)
                for arr, t in zip(ptrs, tap, strict=True):
                    arr[i] = t.data_ptr()
            tap_args = [ctypes.addressof(a) for a in ptrs]
        _, nseq, base, cap, start, nnew, row0 = plan.native
        rc = self.fn(
            ctypes.addressof(self.layers), len(model.layers), h.data_ptr(), cfg.rms_norm_eps,
            T, hidden, cos.data_ptr(), sin.data_ptr(), heads, kv_heads, hd,
            first.scale, nseq, base, cap, start, nnew, row0,
            plan.kv_bf16, x.data_ptr(), qkv.data_ptr(), q.data_ptr(), k.data_ptr(),
            v.data_ptr(), attn.data_ptr(), gu.data_ptr(), act.data_ptr(), y.data_ptr(),
            *tap_args,
        )  # fmt: skip
        if rc != 0:
            raise MemoryError(f"native decoder failed ({rc})")
        return y, tap_out
