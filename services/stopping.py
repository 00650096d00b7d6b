"""When a sequence is done: EOS, max_tokens, context limit or a stop string."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def find_stop(text: str, stops: Sequence[str]) -> int:
    """Index where the earliest stop string starts in ``text``, or -1."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else -1


class StopChecker:
    """Checks a growing output; ``check`` returns a finish reason or None.

    Stop strings are matched on the detokenised text, so one split across token (or
    round) boundaries is still found; the text is then cut before the stop string.
    """

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        eos_ids: Sequence[int],
        max_tokens: int,
        stops: Sequence[str] = (),
        ignore_eos: bool = False,
        max_len: int | None = None,
    ) -> None:
        self.decode, self.eos = decode, set() if ignore_eos else set(eos_ids)
        self.max_tokens, self.stops, self.max_len = max_tokens, list(stops), max_len
        self.stop_at: int | None = None  # character index where the text is cut

    def check(self, generated: list[int], total_len: int) -> tuple[str | None, int]:
        """Finish reason (or None) and how many of ``generated`` tokens to keep."""
        for i, tok in enumerate(generated[: self.max_tokens]):
            if tok in self.eos:
                return "stop", i  # EOS itself is not part of the output
        if self.stops:
            text = self.decode(generated)
            cut = find_stop(text, self.stops)
            if cut >= 0:
                self.stop_at = cut
                return "stop", len(generated)
        if len(generated) >= self.max_tokens:
            return "length", self.max_tokens
        if self.max_len is not None and total_len >= self.max_len:
            return "length", len(generated)
        return None, len(generated)
