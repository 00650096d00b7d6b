"""The benchmark prompt mix shared by ``bench throughput`` and ``bench peers``.

``benchmark_mix`` draws the same number of prompts from each of the six held-out
categories (code, math, chat, qa, summarization, translation); here they are interleaved
so that any prefix of the list, even two prompts, spans several categories.
"""

from __future__ import annotations

import math
from itertools import zip_longest

from services.data.prompts import BENCHMARK_SETS, benchmark_mix


def mix_prompts(num_prompts: int, seed: int = 0) -> list[str]:
    """``num_prompts`` user prompts, categories taking turns."""
    per_category = math.ceil(num_prompts / len(BENCHMARK_SETS))
    mix = benchmark_mix(per_category, seed)
    columns = [[p.prompt for p in mix if p.category == c] for c in BENCHMARK_SETS]
    turns = [p for row in zip_longest(*columns) for p in row if p is not None]
    return turns[:num_prompts]


def repeat_to(items: list, n: int) -> list:
    """``items`` repeated in order until there are ``n`` of them."""
    return [items[i % len(items)] for i in range(n)]
