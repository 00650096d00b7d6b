"""The target's taps of every training sequence, computed once and kept on disk.

The target is frozen, so its tapped hidden states and K/V rows of a recorded sequence never
change: computing them once (instead of every epoch) is most of the budget on a CPU.
Layout of a cache folder::

    index.json               meta (target fingerprint, taps, dtype) + one entry per sequence
    part-00000.safetensors   hidden [n, L, d], k / v [n, L, H_kv, hd], tokens [n] (n rows
                             of several sequences, concatenated); for parts holding text
                             the target did not write, greedy [n]: its next token per row

Parts are written as they fill and the index after each part, so an interrupted build
goes on where it stopped, and new records (data still being generated) are added on the
next build. An entry whose tokens changed (other ``max_len``, regenerated data) is
computed again. Reads go through ``safe_open`` (memory-mapped), one sequence at a time.
"""

from __future__ import annotations

import json
import logging
import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from drafter_actor.training.config import TrainError
from drafter_actor.training.data import Sequence
from drafter_actor.training.target_pass import TargetPass

log = logging.getLogger("longspark.train")

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
FORMAT = 1
PART_SEQS = 64  # sequences per part file
FORWARD_TOKENS = 2048  # tokens packed into one target forward


def token_hash(tokens: list[int]) -> int:
    return zlib.crc32(torch.tensor(tokens, dtype=torch.int32).numpy().tobytes())


@dataclass
class Entry:
    part: str
    row: int  # first row in the part
    length: int
    prompt_len: int
    hash: int
    greedy: bool = False  # the part holds the target's greedy next token of every row


class TapCache:
    """Read side: ``get(id)`` -> tokens ``[T]``, hidden ``[T, L, d]``, k, v ``[T, L, H_kv, hd]``."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        raw = json.loads((self.folder / "index.json").read_text())
        self.meta: dict[str, Any] = raw["meta"]
        self.entries = {i: Entry(**e) for i, e in raw["entries"].items()}
        self._files: dict[str, Any] = {}

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self.entries

    def matches(self, seq: Sequence) -> bool:
        return _matches(self.entries.get(seq.id), seq)

    def get(self, seq_id: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(self._read(seq_id, n) for n in ("tokens", "hidden", "k", "v"))  # type: ignore[return-value]

    def next_tokens(self, seq_id: str) -> torch.Tensor | None:
        """The target's greedy token after each row ``[T]``, if cached for this sequence."""
        return self._read(seq_id, "greedy") if self.entries[seq_id].greedy else None

    def _read(self, seq_id: str, name: str) -> torch.Tensor:
        """One tensor's rows of one sequence (the part file is opened once, memory-mapped)."""
        e = self.entries[seq_id]
        f = self._files.get(e.part)
        if f is None:
            f = self._files[e.part] = safe_open(str(self.folder / e.part), framework="pt")
        return f.get_slice(name)[e.row : e.row + e.length]


def _matches(entry: Entry | None, seq: Sequence) -> bool:
    return (
        entry is not None
        and entry.length == len(seq.tokens)
        and entry.prompt_len == seq.prompt_len
        and entry.hash == token_hash(seq.tokens)
        and (entry.greedy or not seq.target_labels)
    )


def cache_meta(target_pass: TargetPass, dtype: str) -> dict[str, Any]:
    c = target_pass.cfg
    return {
        "format": FORMAT,
        "dtype": dtype,
        "arch": c.arch,
        "hidden_size": c.hidden_size,
        "num_layers": c.num_layers,
        "num_kv_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab_size,
        "rope_theta": c.rope_theta,
        "tap_layer_ids": list(c.tap_layer_ids),
    }


def build_tap_cache(
    folder: str | Path,
    seqs: list[Sequence],
    target_pass: TargetPass,
    dtype: str = "float16",
    progress: bool = True,
) -> tuple[TapCache, dict[str, float]]:
    """Compute (or complete) the cache of ``seqs``; returns it and the build's timing."""
    from tqdm import tqdm

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    meta = cache_meta(target_pass, dtype)
    index_path = folder / "index.json"
    entries: dict[str, dict] = {}
    if index_path.is_file():
        raw = json.loads(index_path.read_text())
        if raw.get("meta") == meta:
            entries = raw["entries"]
        else:
            log.info("tap cache %s was built for other settings: rebuilding", folder)
            for old in folder.glob("part-*.safetensors"):
                old.unlink()
    todo = [s for s in seqs if not _matches(Entry(**entries[s.id]) if s.id in entries else None, s)]
    todo.sort(key=lambda s: s.target_labels)  # parts of one kind: greedy tokens where needed
    parts = [int(p.stem.split("-")[1]) for p in folder.glob("part-*.safetensors")]
    next_part = max(parts, default=-1) + 1
    stats = {"sequences": float(len(todo)), "tokens": 0.0, "seconds": 0.0}
    bar = tqdm(total=len(todo), disable=not progress, unit="seq", desc="tap cache")
    t0 = time.perf_counter()
    for start in range(0, len(todo), PART_SEQS):
        group = todo[start : start + PART_SEQS]
        greedy = any(s.target_labels for s in group)
        taps = _compute(target_pass, group, DTYPES[dtype], bar, greedy)
        name = f"part-{next_part:05d}.safetensors"
        next_part += 1
        tensors = {
            "tokens": torch.tensor([t for s in group for t in s.tokens], dtype=torch.int32),
            "hidden": torch.cat([t[0] for t in taps]),
            "k": torch.cat([t[1] for t in taps]),
            "v": torch.cat([t[2] for t in taps]),
        }
        if greedy:
            tensors["greedy"] = torch.cat([t[3] for t in taps]).to(torch.int32)
        tmp = folder / (name + ".tmp")
        save_file(tensors, str(tmp))
        os.replace(tmp, folder / name)
        row = 0
        for s in group:
            entries[s.id] = dict(
                part=name,
                row=row,
                length=len(s.tokens),
                prompt_len=s.prompt_len,
                hash=token_hash(s.tokens),
                greedy=greedy,
            )
            row += len(s.tokens)
        stats["tokens"] += row
        _write_index(index_path, meta, entries)
    bar.close()
    stats["seconds"] = time.perf_counter() - t0
    if not index_path.is_file():
        _write_index(index_path, meta, entries)
    return TapCache(folder), stats


def _compute(
    target_pass: TargetPass, group: list[Sequence], dtype: torch.dtype, bar, greedy: bool
) -> list:
    out: list = [None] * len(group)
    order = sorted(range(len(group)), key=lambda i: len(group[i].tokens))
    i = 0
    while i < len(order):
        pack, n = [], 0
        while i < len(order) and (not pack or n + len(group[order[i]].tokens) <= FORWARD_TOKENS):
            pack.append(order[i])
            n += len(group[order[i]].tokens)
            i += 1
        for j, taps in zip(
            pack, target_pass.taps([group[j].tokens for j in pack], greedy), strict=True
        ):
            out[j] = tuple(_cast(x, dtype) for x in taps[:3]) + taps[3:]
        bar.update(len(pack))
    return out


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float16 and float(x.abs().max()) > 65000:
        raise TrainError(
            f"target activations reach {float(x.abs().max()):.0f}, beyond float16: "
            "use cache_dtype bfloat16 or float32"
        )
    return x.to(dtype).contiguous()


def _write_index(path: Path, meta: dict, entries: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"meta": meta, "entries": entries}))
    os.replace(tmp, path)
