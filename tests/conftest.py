"""Shared fixtures: tiny random checkpoints (seconds) and the real default model (slow)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def make_tiny_checkpoint(folder: Path, arch: str, **overrides) -> Path:
    """Save a seeded random transformers model of ``arch`` (llama|qwen2|qwen3) to ``folder``."""
    import transformers

    kwargs = {**TINY, **overrides}
    if arch == "llama":
        cfg = transformers.LlamaConfig(**kwargs)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**kwargs)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        kwargs.setdefault("head_dim", 32)
        cfg = transformers.Qwen3Config(**kwargs)
        cls = transformers.Qwen3ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(0)
    model = cls(cfg).float().eval()
    with torch.no_grad():  # non-trivial norms and biases so a missed weight shows up
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_checkpoint(root / arch, arch) for arch in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The converted default model (``longspark model fetch`` puts it there)."""
    from target_actor.checkpoint import fetch_default_model

    return fetch_default_model()


def pytest_configure(config):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from api import proxy_guard

    proxy_guard.install()  # every Ray a test starts runs Serve's proxies behind the guard


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_chat_model(folder: Path, arch: str = "qwen3", **overrides) -> Path:
    """A tiny random model with a real (byte-level BPE) tokenizer and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(
        ["The quick brown fox jumps over the lazy dog. Hello world."] * 4, trainer
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        bos_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
    make_tiny_checkpoint(
        folder, arch, vocab_size=len(fast), eos_token_id=fast.eos_token_id, **overrides
    )
    fast.save_pretrained(folder)
    return folder
