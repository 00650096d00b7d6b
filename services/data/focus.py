"""Pick training prompts by task kind, so the drafter sees the kinds of text it serves.

Random ShareGPT first turns are mostly open chat and code; short factual questions,
maths, summaries and translations are rare in it. :func:`focus_pool` keeps the prompts a
set of simple rules puts in the asked kinds and interleaves them round-robin, one kind at
a time in the seeded order, so every kind is represented before any is exhausted.

The kinds are named after the evaluation categories, but the prompts stay ShareGPT's:
no benchmark item enters training data (``services.data.prompts`` removes overlaps first).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from services.data.prompts import Prompt
from target_actor.errors import LongSparkError

_RULES: dict[str, re.Pattern[str]] = {
    "code": re.compile(
        r"\bdef |\bpython\b|\bfunction\b|\bcode\b|\bjavascript\b|\bjava\b|\bsql\b|"
        r"\bscript\b|\bclass\b|c\+\+",
        re.I,
    ),
    "math": re.compile(
        r"\bcalculate\b|\bhow many\b|\bhow much\b|\bsolve\b|\bequation\b|\bmath\b|"
        r"\bprobability\b|\d+\s*[+*×]\s*\d+|\d+ [-/] \d+",
        re.I,
    ),
    "summarisation": re.compile(r"\bsummar|\btl;?dr\b|\bmain points\b", re.I),
    "translation": re.compile(
        r"\btranslat|\binto (?:french|spanish|german|chinese|english|korean|japanese)\b", re.I
    ),
}
QA_MAX_WORDS = 25
# the rarer kinds first: a prompt matching several rules counts for the rarest; "chat" is
# every prompt no rule matches (open questions, writing, advice: what MT-Bench asks)
KINDS = ("translation", "summarisation", "math", "qa", "code", "chat")


class FocusError(LongSparkError, ValueError):
    """An unknown kind (one-line message)."""


def parse_kinds(spec: str) -> list[str]:
    """``"math,qa"`` -> ``["math", "qa"]``; a clear error for an unknown kind."""
    kinds = [k.strip() for k in spec.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise FocusError(
            f"unknown prompt kind {', '.join(unknown) or repr(spec)}; choose from {', '.join(KINDS)}"
        )
    return list(dict.fromkeys(kinds))


def kind_of(text: str) -> str:
    """The kind the rules give a prompt; ``"chat"`` when no rule matches."""
    for kind in KINDS[:-1]:  # every kind but "chat", which is what is left
        if kind == "qa":
            stripped = text.strip()
            if stripped.endswith("?") and len(stripped.split()) <= QA_MAX_WORDS:
                return kind
        elif _RULES[kind].search(text):
            return kind
    return "chat"


def focus_pool(pool: Sequence[Prompt], kinds: Iterable[str]) -> list[Prompt]:
    """The prompts of ``kinds`` in ``pool``, interleaved one kind at a time, order kept."""
    queues: dict[str, list[Prompt]] = {k: [] for k in kinds}
    for p in pool:
        kind = kind_of(p.prompt)
        if kind in queues:
            queues[kind].append(p)
    out: list[Prompt] = []
    depth = max((len(q) for q in queues.values()), default=0)
    for i in range(depth):
        out.extend(q[i] for q in queues.values() if i < len(q))
    return out
