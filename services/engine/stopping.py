"""When a sequence is done: EOS, max_tokens, context limit or a stop string."""

from __future__ import annotations

from collections.abc import Sequence


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> int:
    """Index where the earliest stop string starts in ``text[start:]`` (absolute), or -1."""
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else -1


class StopChecker:
    """Decides after each round whether a sequence is finished, and where to cut it.

    EOS, ``max_tokens`` and the context limit are checked on the newly committed tokens
    only; stop strings on the detokenised text (so one split across tokens or rounds is
    still found) and the text is cut before the stop string.
    """

    def __init__(
        self,
        eos_ids: Sequence[int],
        max_tokens: int,
        stops: Sequence[str] = (),
        ignore_eos: bool = False,
        max_len: int | None = None,
    ) -> None:
        self.eos = frozenset() if ignore_eos else frozenset(eos_ids)
        self.max_tokens, self.stops, self.max_len = max_tokens, list(stops), max_len
        self.holdback = max((len(s) for s in self.stops), default=1) - 1

    def check_tokens(
        self, output: list[int], num_new: int, total_len: int
    ) -> tuple[str | None, int]:
        """Finish reason (or None) and how many output tokens to keep (EOS is dropped)."""
        for i in range(len(output) - num_new, len(output)):
            if i >= self.max_tokens:
                return "length", self.max_tokens
            if output[i] in self.eos:
                return "stop", i
        if len(output) >= self.max_tokens:
            return "length", self.max_tokens
        if self.max_len is not None and total_len >= self.max_len:
            return "length", len(output)
        return None, len(output)

    def check_text(self, text: str, searched: int) -> int:
        """Cut index of the first stop string in ``text`` (searching from ``searched``), or -1."""
        if not self.stops:
            return -1
        return find_stop(text, self.stops, max(0, searched - self.holdback))
