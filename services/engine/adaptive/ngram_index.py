"""A sequence's recent n-grams, indexed as its ids grow, for engine-side context copies.

The engine looks up every running sequence's longest recent match each round
(``services.engine.adaptive.copies``). Scanning the last ``WINDOW`` ids with the drafter's rule
(``drafter_actor.context_copy.find_copy``) costs O(window) a sequence a round, which adds
up at 32 long sequences. This index keeps the most recent end
of every n-gram of ``MIN_NGRAM..MAX_NGRAM`` ids, updated with each round's new ids and
dropping those that left the window (at most ``MAX_NGRAM - 1`` entries per id of the
window), so a look-up is at most ``MAX_NGRAM - 1`` dict reads. It finds what
``find_copy`` finds on the same window (a unit test compares them): the longest suffix
match, the most recent of the longest, and the continuation that overlaps itself when it
reaches the anchor.
"""

from __future__ import annotations

from collections import deque

from drafter_actor.context_copy import MAX_NGRAM, MIN_NGRAM
from target_actor.messages import HISTORY_TOKENS

WINDOW = HISTORY_TOKENS + 1  # the ids a match is searched in: the history, then the anchor


class NgramIndex:
    """Most recent end of each n-gram among a sequence's ids, the anchor's excepted.

    ``window``: the ids a match may lie in, the anchor included. ``ids`` keeps absolute
    indices: a prompt longer than the window starts with placeholder ids, never indexed.
    """

    def __init__(self, window: int = WINDOW) -> None:
        self.window = window
        self.ids: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> its most recent end index
        self._added: deque[tuple[int, tuple[int, ...]]] = deque()  # (start, n-gram), in order
        self._indexed = 0  # n-grams ending before this index are in _last

    def sync(self, prompt_ids: list[int], output_ids: list[int]) -> None:
        """Take in the ids committed since the last call."""
        if len(prompt_ids) + len(output_ids) < len(self.ids):  # ids were cut: start over
            self.__init__(self.window)
        if not self.ids:  # the first call: the prompt's ids that can ever match
            start = max(0, len(prompt_ids) - self.window)
            self.ids = [0] * start + prompt_ids[start:]
            self._indexed = start
        self.ids.extend(output_ids[len(self.ids) - len(prompt_ids) :])
        ids, last, added, floor = self.ids, self._last, self._added, self._floor()
        for end in range(self._indexed, len(ids) - 1):  # every end before the anchor
            for n in range(MIN_NGRAM, min(MAX_NGRAM, end - floor + 1) + 1):
                gram = tuple(ids[end - n + 1 : end + 1])
                last[gram] = end
                added.append((end - n + 1, gram))
        self._indexed = max(self._indexed, len(ids) - 1)
        while added and added[0][0] < floor:  # left the window: can never match again
            begin, gram = added.popleft()
            if last.get(gram, -1) - len(gram) + 1 == begin:  # not seen again since
                del last[gram]

    def copy(self, limit: int) -> tuple[list[int], int]:
        """The continuation (``limit`` ids) of the longest match of the ids' suffix, and
        its length; ``([], 0)`` without a match of ``MIN_NGRAM``."""
        ids, N = self.ids, len(self.ids)
        start = max(0, N - self.window)
        for n in range(min(MAX_NGRAM, N - start - 1), MIN_NGRAM - 1, -1):
            end = self._last.get(tuple(ids[N - n :]))
            if end is not None and end - n + 1 >= start:
                follow = ids[end + 1 : min(N, end + 1 + limit)]
                if len(follow) < limit:  # it reaches the anchor: the copy overlaps itself
                    follow = [ids[end + 1 + j % (N - end - 1)] for j in range(limit)]
                return follow, n
        return [], 0

    def _floor(self) -> int:
        """The oldest index an n-gram may start at (older ones are outside every window)."""
        return max(0, len(self.ids) - self.window)


__all__ = ["WINDOW", "NgramIndex"]
