"""Every ``longspark`` command the README and docs show runs, at tiny sizes, as a user runs it.

Behaviour is checked where it is cheap (exit status, the JSON's keys, identity with the
reference); speed never is. ``serve`` and ``loadtest`` run in ``test_hardening_sigterm``,
``bench throughput | peers | spec | drafter`` in ``test_bench_smoke``, ``generate`` and
``model path`` in ``test_cli``; the rest is here.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def longspark(*args: str, timeout_s: float = 600) -> dict | list | str:
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    try:
        return json.loads(proc.stdout)
    except ValueError:
        return proc.stdout


def test_model_fetch_and_data_fetch_are_idempotent(smollm2_path):
    assert longspark("model", "fetch").strip() == str(smollm2_path)
    sets = dict(line.split("\t") for line in longspark("data", "fetch").strip().splitlines())
    assert {"sharegpt", "humaneval", "mtbench"} <= set(sets) and all(
        int(n) > 0 for n in sets.values()
    )


def test_bench_decode(smollm2_path, tmp_path):
    out = tmp_path / "decode.json"
    longspark("bench", "decode", "--max-tokens", "4", "--repeats", "1", "--json", str(out))
    report = json.loads(out.read_text())
    assert report["greedy_tokens_identical_fp32"]
    assert set(report["results"]) == {
        "transformers_fp32",
        "longspark_fp32",
        "longspark_bf16",
        "longspark_int4",
    }


def test_train_data_drafter_export_and_eval(smollm2_path, tmp_path):
    """The training pipeline end to end on SmolLM2, a few records and steps."""
    data, run, shipped = tmp_path / "data", tmp_path / "run", tmp_path / "drafter"
    manifest = longspark(
        "train", "data", "--num-prompts", "6", "--max-tokens", "12", "--batch-size", "6",
        "--out", str(data),
    )  # fmt: skip
    assert manifest["num_records"] == 6
    longspark(
        "train", "drafter", "--data", str(data), "--out", str(run), "--steps", "2",
        "--max-len", "64", "--eval-seqs", "2", "--window", "16", "--summary-slots", "4",
        "--markov-rank", "8", "--draft-vocab", "512", "--k", "4", "--anchors-per-seq", "4",
        "--seqs-per-step", "2", "--summary-chunk", "8", "--ckpt-every", "0", "--no-progress",
        "--threads", "1", "--cache-dtype", "float32",
    )  # fmt: skip
    report = longspark("train", "export", "--drafter", str(run), "--out", str(shipped))
    assert (shipped / "config.json").is_file() and report
    tau = longspark("eval", "offline", "--drafter", str(shipped), "--data", str(data),
                    "--num-seqs", "2", "--k", "4")  # fmt: skip
    assert tau
    acc = longspark(
        "eval", "acceptance", "--drafter", str(shipped), "--per-category", "1",
        "--max-tokens", "4", "--temperatures", "0", "--json",
    )  # fmt: skip
    assert acc
