"""Training data generation on a tiny random target with a character-level chat tokenizer:
shards and manifest, resuming after a kill, settings checks, malformed folders."""

from __future__ import annotations

import json
import string

import pytest

from services.data import train_data as TD
from services.data.prompts import Prompt
from services.data.train_data import TrainDataError, generate_training_data, read_training_data
from services.engine.tokenizer import Tokenizer
from tests.conftest import make_tiny_checkpoint

SPECIAL = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    """A tiny llama with a one-token-per-character tokenizer and a ChatML template."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.printable) - set("\t\r\x0b\x0c"))
    vocab = {t: i for i, t in enumerate(SPECIAL + chars)}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    raw.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        unk_token="<unk>",
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHATML
    folder = tmp_path_factory.mktemp("chat") / "tiny-chat"
    make_tiny_checkpoint(
        folder, "llama", vocab_size=128, max_position_embeddings=512, eos_token_id=3
    )
    tok.save_pretrained(folder)
    return str(folder)


def prompts(n: int) -> list[Prompt]:
    return [Prompt(f"t/{i}", "train", f"Question {i}: what is {i} + {i}?") for i in range(n)]


def run(out, target, n=20, pool=24, **kw):
    kw = {"max_tokens": 6, "batch_size": 4, "progress": False, **kw}
    return generate_training_data(out, n, target=target, prompts=prompts(pool), **kw)


def as_dict(folder) -> dict[str, tuple]:
    recs = list(read_training_data(folder))
    out = {r.id: (r.prompt_ids, r.response_ids, r.finish_reason) for r in recs}
    assert len(out) == len(recs)  # no duplicates
    return out


def test_writes_shards_and_manifest(chat_target, tmp_path, monkeypatch):
    monkeypatch.setattr(TD, "SHARD_SIZE", 8)
    manifest = run(tmp_path / "d", chat_target)
    assert manifest["num_records"] == 20 and manifest["num_prompts"] == 20
    assert [s["num_records"] for s in manifest["shards"]] == [8, 8, 4]
    assert manifest["model"] == "tiny-chat" and manifest["chat_template"] is True
    assert manifest["temperature"] == 0.0 and manifest["max_tokens"] == 6
    assert manifest["vocab_size"] == 128 and manifest["eos_token_ids"] == [3]
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == [
        ".lock",
        "manifest.json",
        "shard-00000.jsonl",
        "shard-00001.jsonl",
        "shard-00002.jsonl",
    ]
    tok = Tokenizer(chat_target)
    by_id = {p.id: p.prompt for p in prompts(24)}
    records = as_dict(tmp_path / "d")
    for rid, (prompt_ids, response_ids, reason) in records.items():
        assert prompt_ids == tok.encode_chat([{"role": "user", "content": by_id[rid]}])
        assert 3 not in response_ids  # EOS never stored
        assert reason == "stop" or len(response_ids) == 6
    # the first 20 of one seeded shuffle of the pool, whatever order they finished in
    assert len(set(records) & set(by_id)) == 20


def test_resume_after_kill_gives_the_same_set(chat_target, tmp_path, monkeypatch):
    monkeypatch.setattr(TD, "SHARD_SIZE", 8)
    run(tmp_path / "fresh", chat_target)
    add_shard = TD._add_shard

    def killed_after_first(*args):
        add_shard(*args)
        raise KeyboardInterrupt

    monkeypatch.setattr(TD, "_add_shard", killed_after_first)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "resumed", chat_target)
    first = (tmp_path / "resumed" / "shard-00000.jsonl").read_bytes()
    assert len(as_dict(tmp_path / "resumed")) == 8
    monkeypatch.setattr(TD, "_add_shard", add_shard)
    manifest = run(tmp_path / "resumed", chat_target)
    assert manifest["num_records"] == 20
    assert (tmp_path / "resumed" / "shard-00000.jsonl").read_bytes() == first  # kept, not redone
    assert as_dict(tmp_path / "resumed") == as_dict(tmp_path / "fresh")
    # rerunning a finished set generates nothing; a larger num_prompts extends it
    assert run(tmp_path / "resumed", chat_target)["shards"] == manifest["shards"]
    assert len(as_dict(tmp_path / "resumed")) == 20
    assert run(tmp_path / "resumed", chat_target, n=22)["num_records"] == 22


def test_sampled_records_do_not_depend_on_batching(chat_target, tmp_path):
    a = run(tmp_path / "a", chat_target, n=6, temperature=1.0, batch_size=1)
    b = run(tmp_path / "b", chat_target, n=6, temperature=1.0, batch_size=4)
    assert a["temperature"] == b["temperature"] == 1.0
    assert as_dict(tmp_path / "a") == as_dict(tmp_path / "b")


def test_mismatching_settings_are_one_line_errors(chat_target, tmp_path):
    run(tmp_path / "d", chat_target, n=4)
    for kw, key in (({"max_tokens": 7}, "max_tokens"), ({"seed": 1}, "seed")):
        with pytest.raises(TrainDataError, match=f"generated with {key}=") as err:
            run(tmp_path / "d", chat_target, n=4, **kw)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"n": 0}, "num_prompts must be a positive integer"),
        ({"max_tokens": 0}, "max_tokens must be a positive integer"),
        ({"batch_size": 0}, "batch_size must be a positive integer"),
        ({"temperature": -1.0}, "temperature must lie in"),
        ({"n": 30}, "only 24 usable prompts"),
        ({"target": "/nonexistent/model"}, "not a local Hugging Face folder"),
        ({"prompt_set": "xsum"}, "unknown training prompt set 'xsum'; choose from sharegpt"),
    ],
)
def test_bad_inputs(chat_target, tmp_path, kw, match):
    kw = {"target": chat_target, **kw}
    with pytest.raises(TrainDataError, match=match) as err:
        run(tmp_path / "d", **kw)
    assert "\n" not in str(err.value)


def test_malformed_folders_are_one_line_errors(chat_target, tmp_path, monkeypatch):
    monkeypatch.setattr(TD, "SHARD_SIZE", 4)
    with pytest.raises(TrainDataError, match="does not exist"):
        read_training_data(tmp_path / "empty")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TrainDataError, match="no manifest.json"):
        read_training_data(tmp_path / "empty")
    d = tmp_path / "d"
    run(d, chat_target, n=8)
    shard = d / "shard-00001.jsonl"
    good = shard.read_text()
    lines = good.splitlines()
    cases = [
        ("{not json", "shard-00001.jsonl:1: malformed record"),
        (lines[0].replace('"finish_reason": "', '"finish_reason": "x'), "finish_reason"),
        (json.dumps({**json.loads(lines[0]), "response_ids": [1, 999]}), "response_ids"),
        (json.dumps({**json.loads(lines[0]), "prompt_ids": []}), "prompt_ids is empty"),
        ("\n".join(lines[:2]), "holds 2 records, manifest.json says 4"),
        ("\n".join([lines[0], lines[0], *lines[2:]]), "duplicate record id"),
    ]
    for text, match in cases:
        shard.write_text(text + "\n")
        with pytest.raises(TrainDataError, match=match) as err:
            list(read_training_data(d))
        assert "\n" not in str(err.value)
    shard.write_text("{not json\n")
    with pytest.raises(TrainDataError, match="malformed record"):  # resuming reads it too
        run(d, chat_target, n=8)
    shard.write_text(good)
    (d / "shard-00009.jsonl").write_text(good)
    with pytest.raises(TrainDataError, match="shard-00009.jsonl is not in manifest.json"):
        read_training_data(d)
    (d / "shard-00009.jsonl").unlink()
    shard.unlink()
    with pytest.raises(TrainDataError, match="shard-00001.jsonl is missing"):
        read_training_data(d)
    (d / "manifest.json").write_text("{}")
    with pytest.raises(TrainDataError, match="manifest.json is malformed"):
        read_training_data(d)
    with pytest.raises(TrainDataError, match="manifest.json is malformed"):
        run(d, chat_target, n=8)


# -- ShareGPT's own replies (services.data.train_replies) ---------------------------------------


def test_reply_data_keeps_replies_after_the_skipped_prompts(chat_target, tmp_path):
    from services.data.train_replies import build_reply_data

    pool = prompts(10)
    replies = {p.id: f"Answer {i}." for i, p in enumerate(pool)}
    replies[pool[3].id] = ""  # no usable reply: skipped
    replies[pool[4].id] = "x" * 50  # longer than max_tokens: cut, "length"
    manifest = build_reply_data(
        tmp_path / "r",
        20,
        skip_prompts=2,
        max_tokens=12,
        target=chat_target,
        prompts=pool,
        replies=replies,
    )
    assert manifest["responses"] == "sharegpt" and manifest["skip_prompts"] == 2
    assert manifest["vocab_size"] == 128 and manifest["eos_token_ids"] == [3]
    recs = as_dict(tmp_path / "r")
    import random

    order = list(pool)
    random.Random(0).shuffle(order)
    expected = [p.id for p in order[2:] if replies[p.id]]
    assert list(recs) == expected and manifest["num_records"] == len(expected)
    for pid, (_, response_ids, reason) in recs.items():
        text = replies[pid]
        assert reason == ("length" if len(text) > 12 else "stop")
        assert len(response_ids) == min(len(text), 12)
    with pytest.raises(TrainDataError, match="not empty"):
        build_reply_data(tmp_path / "r", 5, target=chat_target, prompts=pool, replies=replies)
    with pytest.raises(TrainDataError, match="skip_prompts"):
        build_reply_data(tmp_path / "s", 5, skip_prompts=-1, target=chat_target, prompts=pool)
