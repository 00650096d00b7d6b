"""A model's quantized GEMM weights in one buffer that Linux backs with 2 MB pages.

A decode step streams every weight once, ~90 MB for the default model. In 4 KB pages that
is a TLB miss every 4 KB of weights, and the prefetch the GEMMs issue a tile ahead lands on
pages not yet mapped in the TLB. Transparent huge pages fix that, but on most hosts
(``/sys/kernel/mm/transparent_hugepage/enabled`` = ``madvise``) only for memory a process
advises, and each linear's tensors are small separate allocations. So after the weights
are final, ``into_arena`` copies them into one anonymous mapping advised
``MADV_HUGEPAGE`` and points the linears at views of it. Where the kernel declines (THP
``never``, no ``MADV_HUGEPAGE``), the weights still work from the mapping in 4 KB pages.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor starts on a cache line


def _nbytes(t: torch.Tensor) -> int:
    return -(-t.numel() * t.element_size() // ALIGN) * ALIGN


class Arena:
    """``nbytes`` of memory starting on a 2 MB boundary, advised for huge pages; ``take``
    copies a tensor into the next free bytes. The views hold the mapping alive."""

    def __init__(self, nbytes: int) -> None:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # private: shared memory takes no THP
        self._map = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=flags)
        try:  # before the first touch: the pages are chosen when first written
            self._map.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):
            pass
        whole = torch.frombuffer(self._map, dtype=torch.uint8)
        start = -whole.data_ptr() % HUGE_PAGE
        self.buf, self.used = whole[start : start + nbytes], 0

    def take(self, t: torch.Tensor) -> torch.Tensor:
        n = t.numel() * t.element_size()
        view = self.buf[self.used : self.used + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        self.used += _nbytes(t)
        return view


def into_arena(holders: Iterable[object]) -> Arena | None:
    """Move every CPU tensor attribute of ``holders`` (the quantized linears: their packed
    weights and scales) into one ``Arena``; None when they are too few to fill a huge page."""
    found = [
        (h, name)
        for h in holders
        for name, v in vars(h).items()
        if isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.numel() > 0
    ]
    total = sum(_nbytes(getattr(h, name)) for h, name in found)
    if total < HUGE_PAGE:
        return None
    arena = Arena(total)
    for h, name in found:
        setattr(h, name, arena.take(getattr(h, name).contiguous()))
    return arena
