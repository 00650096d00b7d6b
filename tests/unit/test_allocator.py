"""The training allocator setting: applied where the C library is glibc, harmless after."""

import ctypes.util

import torch

from drafter_actor.training.allocator import keep_freed_memory


def test_keep_freed_memory_applies_on_glibc_and_allocations_still_work():
    ok = keep_freed_memory()
    if "libc.so" in (ctypes.util.find_library("c") or ""):  # glibc
        assert ok
    big = torch.ones(64, 1 << 20)  # 256 MiB: above glibc's mmap threshold
    assert float(big.sum()) == 64 * (1 << 20)
    del big
    assert keep_freed_memory() == ok  # idempotent
