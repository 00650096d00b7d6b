"""Picking training prompts by kind (services.data.focus) and generating data from a
focused, skipped slice of the seeded order (services.data.train_data)."""

from __future__ import annotations

import json
import random

import pytest

from services.data.focus import FocusError, focus_pool, kind_of, parse_kinds
from services.data.prompts import Prompt
from services.data.train_data import TrainDataError, generate_training_data, read_training_data
from tests.unit.test_train_data import chat_target  # noqa: F401 - the fixture


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("Translate this sentence into German: good morning", "translation"),
        ("Summarize the following article in three sentences: ...", "summarisation"),
        ("Calculate the area of a circle of radius 3.", "math"),
        ("A shop sells 12 + 7 apples; how many are left? Show your work.", "math"),
        ("who wrote the book war and peace?", "qa"),
        ("Write a python function that reverses a list.", "code"),
        ("Tell me a story about a dragon who loves tea.", "chat"),
        ("Current date: 3/17/2023. Tell me a story.", "chat"),  # a date is not arithmetic
    ],
)
def test_kind_of(text, kind):
    assert kind_of(text) == kind


def test_a_prompt_of_several_kinds_counts_for_the_rarest():
    assert kind_of("Translate this python code comment into French") == "translation"


def test_parse_kinds_rejects_unknown_and_empty():
    assert parse_kinds("math, qa,math") == ["math", "qa"]
    with pytest.raises(FocusError, match="unknown prompt kind poetry; choose from"):
        parse_kinds("math,poetry")
    with pytest.raises(FocusError, match="unknown prompt kind"):
        parse_kinds(" , ")


def test_focus_pool_interleaves_kinds_in_order():
    texts = [
        "write python code for a queue",  # code
        "what is the capital of France?",  # qa
        "write java code for a stack",  # code
        "tell me a joke",  # none
        "write a javascript function",  # code
        "who is the president of Chile?",  # qa
        "calculate 3 * 4",  # math, not asked
    ]
    pool = [Prompt(f"s/{i}", "train", t) for i, t in enumerate(texts)]
    picked = [p.id for p in focus_pool(pool, ["qa", "code"])]
    assert picked == ["s/1", "s/0", "s/5", "s/2", "s/4"]
    # "chat": what no rule matches
    assert [p.id for p in focus_pool(pool, ["chat"])] == ["s/3"]


def kinds_pool() -> list[Prompt]:
    texts = [f"write python code number {i}" for i in range(6)]
    texts += [f"what is {i} squared?" for i in range(6)]
    texts += [f"tell me story {i}" for i in range(6)]
    return [Prompt(f"k/{i}", "train", t) for i, t in enumerate(texts)]


def test_generation_keeps_the_focused_prompts_after_the_skipped(chat_target, tmp_path):  # noqa: F811
    pool = kinds_pool()
    order = list(pool)
    random.Random(0).shuffle(order)
    expected = [p.id for p in order[3:] if kind_of(p.prompt) == "qa"]
    n = len(expected)
    assert 0 < n < 6  # the skip left some questions out
    kw = dict(max_tokens=4, batch_size=4, progress=False, target=chat_target, prompts=pool)
    manifest = generate_training_data(tmp_path / "f", n, skip_prompts=3, focus=["qa"], **kw)
    assert manifest["skip_prompts"] == 3 and manifest["focus"] == ["qa"]
    assert sorted(r.id for r in read_training_data(tmp_path / "f")) == sorted(expected)
    # resuming with other settings names the setting
    with pytest.raises(TrainDataError, match="focus=\\['qa'\\], not \\['code'\\]"):
        generate_training_data(tmp_path / "f", n, skip_prompts=3, focus=["code"], **kw)
    with pytest.raises(TrainDataError, match="skip_prompts=3, not 0"):
        generate_training_data(tmp_path / "f", n, focus=["qa"], **kw)
    with pytest.raises(TrainDataError, match="skip_prompts must be >= 0"):
        generate_training_data(tmp_path / "g", 6, skip_prompts=-1, **kw)


def test_a_manifest_from_before_focus_resumes(chat_target, tmp_path):  # noqa: F811
    pool = kinds_pool()
    kw = dict(max_tokens=4, batch_size=4, progress=False, target=chat_target, prompts=pool)
    generate_training_data(tmp_path / "old", 4, **kw)
    path = tmp_path / "old" / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["skip_prompts"], manifest["focus"]
    path.write_text(json.dumps(manifest))
    assert generate_training_data(tmp_path / "old", 6, **kw)["num_records"] == 6
