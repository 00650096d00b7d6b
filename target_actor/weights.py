"""Read a checkpoint's safetensors, each TP rank only its own shard.

``CheckpointReader`` maps tensor names to files (single file or sharded with an
index) and returns whole tensors or row / column slices read with ``get_slice``, so a
rank never materialises the other ranks' parts.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from target_actor.config import TargetConfigError


class CheckpointReader:
    def __init__(self, folder: str | Path, dtype: torch.dtype = torch.float32) -> None:
        self.folder = Path(folder)
        self.dtype = dtype
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: self.folder / f for name, f in weight_map.items()}
        else:
            self.files = {}
            for path in sorted(self.folder.glob("*.safetensors")):
                with safe_open(path, framework="pt") as f:
                    self.files.update({name: path for name in f.keys()})
        if not self.files:
            raise TargetConfigError(f"no safetensors weights found in {self.folder}")
        self._handles: dict[Path, object] = {}

    def has(self, name: str) -> bool:
        return name in self.files

    def _slice(self, name: str):
        if name not in self.files:
            raise TargetConfigError(f"checkpoint {self.folder} lacks tensor {name!r}")
        path = self.files[name]
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="pt")
        return self._handles[path].get_slice(name)

    def get(self, name: str) -> torch.Tensor:
        return self._slice(name)[:].to(self.dtype)

    def rows(self, name: str, start: int, size: int) -> torch.Tensor:
        """Rows ``start:start+size`` (dim 0): column-parallel weights, biases, vocab shards."""
        return self._slice(name)[start : start + size].to(self.dtype)

    def cols(self, name: str, start: int, size: int) -> torch.Tensor:
        """Columns ``start:start+size`` (dim 1): row-parallel weights."""
        return self._slice(name)[:, start : start + size].to(self.dtype)

    def close(self) -> None:
        self._handles.clear()
