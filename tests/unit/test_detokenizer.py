"""Incremental detokenisation gives the decode of all the ids, round after round."""

from __future__ import annotations

import random

from services.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "plain ascii, then accents: café, naïve, Ærøskøbing",
    "CJK 東京都は日本の首都です and emoji 🙂👍🏽 mixed in 🚀",
    "code:\n    def f(x):\n        return x ** 2  # ≥ 0\n",
]


def byte_decode(ids: list[int]) -> str:
    """A byte-level tokenizer's decode: one id per byte, incomplete UTF-8 replaced."""
    return bytes(ids).decode("utf-8", errors="replace")


def rounds(ids: list[int], rng: random.Random):
    """``ids`` growing by 1-8 ids a round, as a speculative round commits them."""
    n = 0
    while n < len(ids):
        n = min(len(ids), n + rng.randint(1, 8))
        yield ids[:n]


def test_byte_level_text_equals_the_full_decode_every_round():
    rng = random.Random(0)
    for text in TEXTS:
        ids = list(text.encode())
        for _ in range(20):
            detok = IncrementalDetokenizer(byte_decode)
            for prefix in rounds(ids, rng):
                assert detok.text(prefix) == byte_decode(prefix)
        assert detok.text(ids) == text


def test_a_split_character_is_replaced_until_its_bytes_arrive():
    ids = list("a🙂b".encode())  # the emoji is 4 bytes
    detok = IncrementalDetokenizer(byte_decode)
    assert detok.text(ids[:3]) == "a\ufffd"
    assert detok.text(ids[:5]) == "a🙂"
    assert detok.text(ids) == "a🙂b"


def test_context_dependent_pieces_decode_as_inside_the_whole_text():
    # SentencePiece-style: "▁" marks a space, and a decode drops the text's leading space
    vocab = ["▁Hello", ",", "▁world", "▁again", "!", "▁x"]

    def decode(ids: list[int]) -> str:
        return "".join(vocab[i] for i in ids).replace("▁", " ").lstrip(" ")

    ids = [0, 1, 2, 3, 4, 5, 2, 3, 1, 5]
    rng = random.Random(1)
    for _ in range(20):
        detok = IncrementalDetokenizer(decode)
        for prefix in rounds(ids, rng):
            assert detok.text(prefix) == decode(prefix)


def test_special_ids_as_the_only_context_keep_the_next_space():
    # a SentencePiece decode drops one leading space; "</s>" ids decode to nothing
    vocab = ["</s>", "▁Hello", "▁world"]

    def decode(ids: list[int]) -> str:
        text = "".join(vocab[i] for i in ids if i != 0).replace("▁", " ")
        return text[1:] if text.startswith(" ") else text

    ids = [1, 0, 0, 0, 0, 0, 2]
    detok = IncrementalDetokenizer(decode)
    assert detok.text(ids[:6]) == "Hello"
    assert detok.text(ids) == decode(ids) == "Hello world"


def test_ids_cut_below_what_was_read_start_over():
    ids = list(TEXTS[1].encode())
    detok = IncrementalDetokenizer(byte_decode)
    detok.text(ids[:40])
    assert detok.text(ids[:10]) == byte_decode(ids[:10])
    assert detok.text(ids) == TEXTS[1]


def test_each_round_decodes_only_the_context_and_the_new_ids():
    seen: list[int] = []

    def counting_decode(ids: list[int]) -> str:
        seen.append(len(ids))
        return byte_decode(ids)

    ids = list(("word " * 400).encode())
    detok = IncrementalDetokenizer(counting_decode)
    for n in range(8, len(ids) + 1, 8):
        detok.text(ids[:n])
    assert detok.text(ids) == "word " * 400
    assert max(seen) <= 5 + 8  # context ids + one round's ids, never the whole output
