"""The training allocator setting: applied where the C library is glibc, harmless after.

It runs in a child process: the setting is process-wide, and the test suite's own process
should keep glibc's defaults.
"""

import subprocess
import sys

CHILD = """
import ctypes.util, torch
from drafter_actor.training.allocator import keep_freed_memory
ok = keep_freed_memory()
big = torch.ones(64, 1 << 20)  # 256 MiB: above glibc's mmap threshold
assert float(big.sum()) == 64 * (1 << 20)
del big
assert keep_freed_memory() == ok  # idempotent
print(ok, "libc.so" in (ctypes.util.find_library("c") or ""))
"""


def test_keep_freed_memory_applies_on_glibc_and_allocations_still_work():
    out = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split()
    applied, glibc = out == ["True", "True"], out[1] == "True"
    assert applied or not glibc
