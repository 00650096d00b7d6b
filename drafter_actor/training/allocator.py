"""Keep freed memory in the process while training (glibc only).

Every training step allocates and frees the same large activation and gradient tensors.
glibc serves blocks above its mmap threshold with fresh ``mmap`` pages and returns them
on free, so each step faults about a gigabyte of zeroed pages back in: half of the CPU
time went to the kernel. Serving every block from the heap and never trimming it keeps
those pages mapped from one step to the next: 2.08 -> 1.41 s a step for the default
drafter on the 2-core CI machine (same 40 batches; docs/experiments/performance.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Stop glibc from unmapping freed blocks; False where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
    if not ok:
        log.info("mallopt refused: freed memory goes back to the system as before")
    return ok
