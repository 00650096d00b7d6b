"""Speculative decoding on the real default model is token-identical to plain decoding."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.engine.backends import EngineOptions, build_engine
from services.engine.params import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    'def is_prime(n):\n    """Return True if n is prime."""\n',
    "Write a SQL query that counts the orders per customer.",
    "Explain what a hash map is in two sentences.",
    "Tom has 3 apples and buys 5 more. He gives 2 away. How many apples does he have?",
    "What is 17 times 23? Show your steps.",
    "A train travels 60 km in 45 minutes. What is its average speed in km/h?",
    "Solve for x: 2x + 7 = 19.",
    "Tell me a short story about a robot who learns to paint.",
    "What are three tips for staying productive when working from home?",
    "Write a haiku about autumn leaves.",
    "How do I make a cup of green tea?",
    "Who wrote the novel Pride and Prejudice?",
    "What is the capital of Australia?",
    "When did the first human land on the Moon?",
    "Summarize in one sentence: The city council voted on Tuesday to expand the bike lane "
    "network by 40 kilometres over the next three years, citing rising cycling numbers.",
    "Summarize: Researchers found that regular walking improves memory in older adults, "
    "according to a study of 300 volunteers over two years.",
    "Translate to French: The weather is beautiful today.",
    "Translate to Spanish: Where is the train station?",
    "Translate to German: I would like a coffee, please.",
]


@pytest.fixture(scope="module")
def chats(smollm2_path):
    from services.engine.tokenizer import Tokenizer

    tok = Tokenizer(smollm2_path)
    return [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]


@pytest.fixture(scope="module")
def plain_outputs(smollm2_path, chats):
    engine, close = build_engine(EngineOptions(mode="ar", max_num_seqs=8))
    try:
        outs = engine.generate(chats, SamplingParams(max_tokens=48))
    finally:
        close()
    return [o.token_ids for o in outs]


WEIGHTS = Path(__file__).resolve().parents[2] / "drafter_actor" / "weights"


def _trained() -> list[str]:
    """The committed trained drafters: the shipped (default) one and the opt-in versions
    (``SmolLM2-135M-Instruct-v<N>``)."""
    from services.engine.backends import shipped_drafter
    from target_actor.checkpoint import default_model_dir

    shipped = shipped_drafter(default_model_dir())
    found = [shipped] if shipped else []
    found += sorted(WEIGHTS.glob("SmolLM2-135M-Instruct-v*"))
    return [str(p) for p in found if (Path(p) / "config.json").is_file()]


def _drafters() -> list:
    """The random drafter always, and every committed trained one."""
    return ["random", *_trained()]


@pytest.fixture(scope="module", params=_drafters())
def spec_engine(smollm2_path, request):
    engine, close = build_engine(
        EngineOptions(mode="spec", drafter=request.param, k=7, adaptive=False, max_num_seqs=8)
    )
    yield engine
    close()


def test_spec_alone_equals_plain(spec_engine, chats, plain_outputs):
    for ids, ref in zip(chats[:6], plain_outputs[:6], strict=True):
        assert spec_engine.generate([ids], SamplingParams(max_tokens=48))[0].token_ids == ref


def test_spec_batched_join_leave_equals_plain(spec_engine, chats, plain_outputs):
    finals = {}
    pending = list(range(len(chats)))
    lengths = [48 if i % 3 else 20 for i in range(len(chats))]  # short ones leave early
    while pending or spec_engine.has_unfinished():
        for _ in range(3 if len(spec_engine.scheduler.running) < 6 else 0):
            if pending:
                i = pending.pop(0)
                spec_engine.add_request(
                    chats[i],
                    SamplingParams(max_tokens=lengths[i]),
                    str(i),
                    on_output=lambda o: o.finished and finals.__setitem__(o.request_id, o),
                )
        spec_engine.step()
    for i, ref in enumerate(plain_outputs):
        got = finals[str(i)].token_ids
        n = len(got)
        assert got == ref[:n] and (n == len(ref) or n == lengths[i]), f"prompt {i}"
    assert spec_engine.target.kv_stats()["num_seqs"] == 0
    assert spec_engine.drafter.num_states() == 0
    assert spec_engine.stats.spec.num_drafts > 0


@pytest.mark.parametrize("drafter", _trained()[:1] or ["random"])
def test_adaptive_k_with_a_trained_drafter_equals_plain(
    smollm2_path, chats, plain_outputs, drafter
):
    """Serving's spec settings (adaptive k) with a trained drafter: plain rounds and drafts mix."""
    opts = EngineOptions(mode="spec", drafter=drafter, adaptive=True, max_num_seqs=8)
    engine, close = build_engine(opts)
    try:
        outs = engine.generate(chats, SamplingParams(max_tokens=48))
    finally:
        close()
    assert [o.token_ids for o in outs] == plain_outputs


def test_the_q8_activation_form_keeps_spec_equal_to_plain(chats):
    """The opt-in ``int4-q8`` form (llama.cpp's one int8 activation plane) rounds every
    GEMM input coarsely, but row by row: a verify block's rows are its decode steps, so
    spec output is plain output in that form too (batched, k=7 blocks)."""
    form = {"dtype": "float32", "quant": "int4-q8"}
    outs = {}
    for mode in ("ar", "spec"):
        extra = {"k": 7, "adaptive": False} if mode == "spec" else {}
        engine, close = build_engine(EngineOptions(mode=mode, max_num_seqs=4, **form, **extra))
        try:
            outs[mode] = [
                o.token_ids for o in engine.generate(chats[:8], SamplingParams(max_tokens=40))
            ]
            if mode == "spec":
                assert engine.stats.spec.num_drafts > 0
        finally:
            close()
    assert outs["spec"] == outs["ar"]
