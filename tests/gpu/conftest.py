"""The GPU tests: every one is skipped where CUDA is not available (``make test`` on a CPU
machine collects them and skips them); ``make test-gpu`` runs them on a GPU machine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def ray_down():
    """Shut down the Ray that ``build_engine`` started for a Ray-backend test."""
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()
