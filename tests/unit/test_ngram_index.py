"""The engine's n-gram index finds what the drafter's context-copy scan finds."""

from __future__ import annotations

import random

import torch

from drafter_actor.context_copy import MIN_NGRAM, find_copy
from services.engine.adaptive.ngram_index import NgramIndex


def scan(ids: list[int], window: int, limit: int) -> tuple[list[int], int]:
    """``find_copy`` on the last ``window`` ids (the history, then the anchor)."""
    tail = ids[-window:]
    copy, n = find_copy(torch.tensor(tail[:-1], dtype=torch.long), tail[-1], limit)
    return (copy, n) if n >= MIN_NGRAM else ([], 0)


def test_index_matches_the_scan_as_ids_grow_past_the_window():
    rng = random.Random(0)
    for vocab, window in ((3, 16), (6, 40), (30, 64)):
        for _ in range(20):  # up to 400 ids: the index forgets what left the window
            text = [rng.randrange(vocab) for _ in range(rng.randint(1, 400))]
            prompt_len = rng.randint(1, len(text))
            index = NgramIndex(window)
            n = prompt_len
            while n <= len(text):
                index.sync(text[:prompt_len], text[prompt_len:n])
                limit = rng.randint(1, 7)
                assert index.copy(limit) == scan(text[:n], window, limit), (vocab, window, n)
                n += rng.randint(1, 8)


def test_a_match_that_left_the_window_is_not_copied():
    pattern, filler = [7, 8, 9], list(range(100, 140))
    ids = pattern + [1] + filler + pattern  # the first "7 8 9" is 44 ids back
    near, far = NgramIndex(64), NgramIndex(16)
    for index in (near, far):
        index.sync(ids, [])
    assert near.copy(3) == ([1, 100, 101], 3)
    assert far.copy(3) == ([], 0)


def test_a_copy_reaching_the_anchor_overlaps_itself():
    index = NgramIndex(32)
    index.sync([4, 5, 4, 5, 4], [5])  # "4 5" recurs right before the anchor
    assert index.copy(5) == ([4, 5, 4, 5, 4], 4) == scan([4, 5, 4, 5, 4, 5], 32, 5)


def test_the_index_holds_one_window_of_ngrams_and_restarts_when_ids_are_cut():
    rng = random.Random(2)
    text = [rng.randrange(1000) for _ in range(2000)]  # nearly every n-gram is new
    text[40:50] = text[20:30]
    index = NgramIndex(64)
    for n in range(10, len(text), 5):
        index.sync(text[:10], text[10:n])
    assert len(index._last) <= 7 * 64  # 2..8-grams starting in the window
    index.sync(text[:10], text[10:50])  # cut: it starts over on these ids
    assert index.copy(3) == scan(text[:50], 64, 3) == (text[30:33], 8)
