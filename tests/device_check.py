"""Where the code creates tensors without naming a device.

On a GPU, a tensor made with ``torch.zeros(n)`` lands on the host: either a hidden copy
each round or a device mismatch. ``unplaced_factories()`` records every torch factory
call made from this project's packages without a ``device`` argument, while the block
runs, so a CPU test can check the GPU path's placement (the per-round code must name
the device of every tensor it makes, ``device="cpu"`` included for host bookkeeping).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = tuple(str(ROOT / p) for p in ("target_actor", "drafter_actor", "services"))

FACTORIES = {
    torch.tensor,
    torch.as_tensor,
    torch.empty,
    torch.zeros,
    torch.ones,
    torch.full,
    torch.arange,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.linspace,
    torch.eye,
    torch.empty_strided,
}


class _Recorder(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.sites: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            frame = sys._getframe(1)
            where = frame.f_code.co_filename
            if where.startswith(PACKAGES):
                self.sites.add(f"{Path(where).relative_to(ROOT)}:{frame.f_lineno} {func.__name__}")
        return func(*args, **kwargs)


@contextlib.contextmanager
def unplaced_factories() -> Iterator[set[str]]:
    """Yields the set of ``file:line factory`` sites hit without a device (filled on exit)."""
    rec = _Recorder()
    with rec:
        yield rec.sites
