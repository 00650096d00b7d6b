"""Training records: target-regenerated responses, read from ``shard-*.jsonl`` files.

A data folder holds ``manifest.json`` (at least ``vocab_size``; ``eos_token_ids``) and
shards of lines ``{"id", "prompt_ids", "response_ids", "finish_reason"}``. Responses
exclude the EOS; a ``"stop"`` record gets its EOS back here, since predicting the end is
part of drafting. A training sequence is prompt + response cut to ``max_len`` tokens; a
prompt that would leave the response less than half of ``max_len`` is cut from the left.

Also here: the reduced draft vocabulary (EAGLE-3's ``d2t``), the most frequent response
tokens, and the held-out split.
"""

from __future__ import annotations

import json
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from drafter_actor.training.config import TrainError, data_folders


@dataclass(frozen=True)
class Record:
    id: str
    prompt_ids: list[int]
    response_ids: list[int]
    finish_reason: str


@dataclass(frozen=True)
class Sequence:
    """One training sequence: ``tokens`` with the response starting at ``prompt_len``."""

    id: str
    tokens: list[int]
    prompt_len: int
    # the response is not the target's own text (e.g. ShareGPT's reply): the labels are
    # the target's greedy next tokens, not the recorded ones (``views.block_labels``)
    target_labels: bool = False
    folder: int = 0  # index of its folder in the data_dir setting

    @property
    def num_anchors(self) -> int:
        """Anchor positions ``prompt_len..len-2`` (each has at least one label)."""
        return max(0, len(self.tokens) - 1 - self.prompt_len)


def read_manifest(data_dir: str | Path) -> dict:
    root = Path(data_dir)
    if not root.is_dir():
        raise TrainError(f"data folder {root} does not exist")
    path = root / "manifest.json"
    if not path.is_file():
        raise TrainError(f"{root} is not a training data folder (no manifest.json)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise TrainError(f"{path} is unreadable: {type(e).__name__}: {e}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("vocab_size"), int):
        raise TrainError(f"{path} is malformed (needs an integer vocab_size)")
    return manifest


def written_by_target(manifest: dict) -> bool:
    """Whether a folder's responses are the target's own (``"responses": "target"``, the
    default) rather than text the target is only labelled on (``"sharegpt"``)."""
    responses = manifest.get("responses", "target")
    if responses not in ("target", "sharegpt"):
        raise TrainError(f"unknown responses kind {responses!r} in manifest.json")
    return responses == "target"


def read_records(data_dir: str | Path, vocab_size: int | None = None) -> list[Record]:
    """Every record of the folder's shards, validated; ``TrainError`` on the first bad line."""
    root = Path(data_dir)
    manifest = read_manifest(root)
    vocab = manifest["vocab_size"]
    if vocab_size is not None and vocab != vocab_size:
        raise TrainError(f"{root}: data vocab_size {vocab} != target vocab_size {vocab_size}")
    shards = sorted(root.glob("shard-*.jsonl"))
    if not shards:
        raise TrainError(f"{root} holds no shard-*.jsonl files")
    records, seen = [], set()
    for shard in shards:
        try:
            lines = shard.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise TrainError(f"cannot read {shard}: {e}") from None
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            rec, problem = _parse(line, vocab)
            if problem:
                raise TrainError(f"{shard}:{lineno}: malformed record ({problem})")
            if rec.id in seen:
                raise TrainError(f"{shard}:{lineno}: duplicate record id {rec.id!r}")
            seen.add(rec.id)
            records.append(rec)
    if not records:
        raise TrainError(f"{root} holds no records")
    return records


def _parse(line: str, vocab: int) -> tuple[Record | None, str]:
    try:
        row = json.loads(line)
        rec = Record(row["id"], row["prompt_ids"], row["response_ids"], row["finish_reason"])
    except (ValueError, KeyError, TypeError) as e:
        return None, f"{type(e).__name__}: {e}"
    if not isinstance(rec.id, str) or not rec.id:
        return None, "id must be a non-empty string"
    if not isinstance(rec.finish_reason, str):
        return None, "finish_reason must be a string"
    for name in ("prompt_ids", "response_ids"):
        ids = getattr(rec, name)
        if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < vocab for t in ids):
            return None, f"{name} must be a list of token ids in 0..{vocab - 1}"
    if not rec.prompt_ids:
        return None, "prompt_ids is empty"
    return rec, ""


def to_sequence(
    rec: Record, max_len: int, eos: int | None, target_labels: bool = False, folder: int = 0
) -> Sequence:
    """Prompt + response (+ EOS after a ``"stop"``), cut to ``max_len`` tokens."""
    response = list(rec.response_ids)
    if rec.finish_reason == "stop" and eos is not None:
        response.append(eos)
    prompt = list(rec.prompt_ids)
    keep = min(len(prompt), max(1, max_len - min(len(response), max_len // 2)))
    prompt = prompt[len(prompt) - keep :]
    tokens = (prompt + response)[:max_len]
    return Sequence(rec.id, tokens, len(prompt), target_labels, folder)


def read_sequences(
    spec: str, vocab_size: int, max_len: int, eos_ids: tuple[int, ...] | list[int] = ()
) -> list[Sequence]:
    """The training sequences (with at least one anchor) of every folder in ``spec``, in
    order; ``eos_ids`` is used where a manifest does not name the EOS.

    A prompt may be in one target-written folder and one of other text (ShareGPT's reply
    to a prompt the target also answered): the target's answer is kept. Any other id
    seen twice is an error."""
    by_id: dict[str, Sequence] = {}
    for index, folder in enumerate(data_folders(spec)):
        manifest = read_manifest(folder)
        by_target = written_by_target(manifest)
        eos_list = manifest.get("eos_token_ids") or list(eos_ids)
        eos = int(eos_list[0]) if eos_list else None
        for rec in read_records(folder, vocab_size):
            seq = to_sequence(rec, max_len, eos, target_labels=not by_target, folder=index)
            old = by_id.get(rec.id)
            if old is not None and old.target_labels == seq.target_labels:
                raise TrainError(f"{folder}: record id {rec.id!r} is also in another folder")
            if old is None or old.target_labels:  # new, or the target's answer replaces
                by_id[rec.id] = seq
    return [seq for seq in by_id.values() if seq.num_anchors > 0]


def repeat_by_folder(seqs: list[Sequence], repeats: tuple[int, ...]) -> list[Sequence]:
    """Each sequence ``repeats[seq.folder]`` times, in order (an epoch that visits a newly
    added folder more often than the rest); ``()`` keeps every sequence once."""
    if not repeats:
        return list(seqs)
    if any(s.folder >= len(repeats) for s in seqs):
        raise TrainError(f"data_repeat names {len(repeats)} folders; the data has more")
    return [s for s in seqs for _ in range(repeats[s.folder])]


def split_holdout(ids: list[str], num: int) -> tuple[list[str], list[str]]:
    """``(train, held out)``: the ``num`` ids of smallest crc32 are held out (stable as data grows)."""
    order = sorted(ids, key=lambda i: (zlib.crc32(i.encode()), i))
    held = set(order[:num])
    return [i for i in ids if i not in held], [i for i in ids if i in held]


def draft_vocabulary(
    seqs: list[Sequence], size: int, vocab_size: int, always: tuple[int, ...] = ()
) -> tuple[torch.Tensor, float]:
    """``d2t`` (sorted target ids) of the ``size`` most frequent response tokens, and the
    fraction of response tokens it covers. ``always`` (EOS) is kept in; ``size == 0`` or
    ``size >= vocab_size`` gives the full vocabulary."""
    counts: Counter[int] = Counter()
    for s in seqs:
        counts.update(s.tokens[s.prompt_len :])
    total = sum(counts.values()) or 1
    if size == 0 or size >= vocab_size:
        return torch.arange(vocab_size), 1.0
    chosen = [t for t in always if 0 <= t < vocab_size][:size]
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    for t, _ in ranked:
        if len(chosen) == size:
            break
        if t not in chosen:
            chosen.append(t)
    taken = set(chosen)
    for t in range(vocab_size):  # fewer distinct tokens than asked: fill with unseen ids
        if len(chosen) == size:
            break
        if t not in taken:
            chosen.append(t)
    d2t = torch.tensor(sorted(chosen), dtype=torch.long)
    covered = sum(counts[t] for t in chosen) / total
    return d2t, covered
