"""Incremental detokenisation with the default model's real tokenizer."""

from __future__ import annotations

import random

import pytest

from services.engine.detokenizer import IncrementalDetokenizer
from services.engine.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

TEXTS = [
    "The capital of France is Paris. It has 2,165,423 inhabitants (2019).",
    "Übersetze ins Deutsche: «Le temps est magnifique aujourd'hui», dit-elle — très bien!",
    "東京都は日本の首都です。人口は約1400万人。 Emoji: 🙂👍🏽🚀 done.",
    "```python\ndef fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n```",
    "Step 1: 3 + 5 = 8.\nStep 2: 8 - 2 = 6.\n#### 6",
]


def test_text_equals_the_full_decode_every_round(smollm2_path):
    tok = Tokenizer(smollm2_path)
    rng = random.Random(0)
    for text in TEXTS:
        ids = tok.encode(text)
        for _ in range(10):
            detok = IncrementalDetokenizer(tok.decode)
            n = 0
            while n < len(ids):
                n = min(len(ids), n + rng.randint(1, 8))
                assert detok.text(ids[:n]) == tok.decode(ids[:n])
    # byte-fallback ids split one character across rounds
    ids = tok.encode("🙂")
    detok = IncrementalDetokenizer(tok.decode)
    for n in range(1, len(ids) + 1):
        assert detok.text(ids[:n]) == tok.decode(ids[:n])
