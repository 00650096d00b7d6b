"""Linear layers with MKL-packed weights for the small row counts a verify block has.

On CPU, ``F.linear`` re-packs the weight for every call; for a few rows (a verify block
of k+1 tokens) that packing traffic costs as much as the math. MKL can pack a weight once
for a given row count M and reuse it: measured here on SmolLM2's shapes, M=8 and M=16
run ~2x faster per layer. Packing is exact only for the M it was made for, so we keep one
pack per configured M and fall back to ``F.linear`` for other shapes. Results equal
``F.linear``'s to float rounding (different summation order), like any other GEMM choice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def mkl_packing_available() -> bool:
    return (
        torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_linear")
        and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
    )


class PackedWeights:
    """One weight ``[out, in]`` (fp32) plus MKL packs for selected row counts."""

    def __init__(self, weight: torch.Tensor, row_counts: tuple[int, ...] = ()) -> None:
        self.weight = weight
        self.packs: dict[int, torch.Tensor] = {}
        if row_counts and weight.dtype == torch.float32 and mkl_packing_available():
            w = weight.contiguous()
            self.weight = w
            self.packs = {m: torch.ops.mkl._mkl_reorder_linear_weight(w, m) for m in row_counts}

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        pack = self.packs.get(x.shape[0]) if x.dim() == 2 else None
        if pack is None:
            return F.linear(x, self.weight, bias)
        return torch.ops.mkl._mkl_linear(x.contiguous(), pack, self.weight, bias, x.shape[0])
