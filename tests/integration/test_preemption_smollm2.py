"""Preemption on the real model, in the served weight form: a small KV pool forces long
prompts (two prefill chunks each) out and back in, and every greedy output equals the
run with room to spare (the recompute rebuilds the KV bit for bit)."""

from __future__ import annotations

import pytest

from services.bench.long_prompts import long_prompts
from services.engine.backends import EngineOptions, build_engine
from services.engine.params import SamplingParams
from services.engine.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

SHORT = [
    "Write a haiku about autumn leaves.",
    "What is 17 times 23? Show your steps.",
    "Translate to French: The weather is beautiful today.",
    "Explain what a hash map is in two sentences.",
]


MAX_TOKENS = 40


def _run(prompts: list[list[int]], kv_tokens: int) -> tuple[list[list[int]], int, int]:
    engine, close = build_engine(EngineOptions(kv_cache_tokens=kv_tokens, max_num_seqs=8))
    try:
        outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        assert engine.scheduler.used_blocks == 0
        assert engine.target.kv_stats()["used_blocks"] == 0
        return [o.token_ids for o in outs], engine.stats.preemptions, engine.scheduler.lookahead
    finally:
        close()


def test_greedy_with_preemption_equals_room_to_spare(smollm2_path):
    tok = Tokenizer(smollm2_path)
    chats = long_prompts(tok, "xsum", 1200, 4) + [[{"role": "user", "content": p}] for p in SHORT]
    prompts = [tok.encode_chat(c) for c in chats]
    assert all(len(p) > 1024 for p in prompts[:4])
    want, none, lookahead = _run(prompts, 65536)

    def blocks(n: int) -> int:
        return -(-n // 16)

    # room for the first two prompts to enter (and the 1% watermark), not to grow to
    # their last token: one of them must be preempted and recomputed
    enter = sum(blocks(len(p) + lookahead) for p in prompts[:2]) + 2
    assert enter < sum(blocks(len(p) + MAX_TOKENS + lookahead) for p in prompts[:2])
    got, preempted, _ = _run(prompts, 16 * enter)
    assert none == 0
    assert preempted > 0
    assert got == want
