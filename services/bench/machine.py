"""What a benchmark ran on, recorded next to its numbers."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    import torch

    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        mem_gib = None
    return {
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "memory_gib": round(mem_gib, 1) if mem_gib else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
    }
