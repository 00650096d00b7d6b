"""When a sequence is done: EOS or a stop token id, max_tokens, the context limit or a stop string."""

from __future__ import annotations

from collections.abc import Sequence


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> tuple[int, int]:
    """Where the earliest stop string starts in ``text[start:]`` (absolute) and where it
    ends, or ``(-1, -1)``."""
    hits = [(i, i + len(s)) for s in stops if (i := text.find(s, start)) >= 0]
    return min(hits) if hits else (-1, -1)


class StopChecker:
    """Decides after each round whether a sequence is finished, and where to cut it.

    EOS, stop token ids, ``max_tokens`` and the context limit are checked on the newly
    committed tokens only; stop strings on the detokenised text (so one split across
    tokens or rounds is still found). The stop token and stop string are cut off unless
    ``include_stop``. Before ``min_tokens`` tokens are out nothing but ``max_tokens`` and
    the context limit stops a sequence (as in vLLM).
    """

    def __init__(
        self,
        eos_ids: Sequence[int],
        max_tokens: int,
        stops: Sequence[str] = (),
        ignore_eos: bool = False,
        max_len: int | None = None,
        stop_token_ids: Sequence[int] = (),
        min_tokens: int = 0,
        include_stop: bool = False,
    ) -> None:
        self.eos = (frozenset() if ignore_eos else frozenset(eos_ids)) | frozenset(stop_token_ids)
        self.max_tokens, self.stops, self.max_len = max_tokens, list(stops), max_len
        self.min_tokens, self.include_stop = min_tokens, include_stop
        self.holdback = max((len(s) for s in self.stops), default=1) - 1

    def check_tokens(
        self, output: list[int], num_new: int, total_len: int
    ) -> tuple[str | None, int]:
        """Finish reason (or None) and how many output tokens to keep."""
        for i in range(len(output) - num_new, len(output)):
            if i >= self.max_tokens:
                return "length", self.max_tokens
            if output[i] in self.eos and i >= self.min_tokens:
                return "stop", i + 1 if self.include_stop else i
        if len(output) >= self.max_tokens:
            return "length", self.max_tokens
        if self.max_len is not None and total_len >= self.max_len:
            return "length", len(output)
        return None, len(output)

    def check_text(self, text: str, searched: int, num_tokens: int) -> int:
        """Where to cut ``text`` at the first stop string found past ``searched`` (after
        it with ``include_stop``), or -1; none counts before ``min_tokens`` tokens."""
        if not self.stops or num_tokens < self.min_tokens:
            return -1
        start, end = find_stop(text, self.stops, max(0, searched - self.holdback))
        return end if self.include_stop and start >= 0 else start
