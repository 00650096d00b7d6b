"""A growing output's text without decoding all of it every round.

Decoding a sequence's whole output each round costs O(n) a round and O(n^2) over the
sequence, which at 32 long sequences costs a real share of a round. Like vLLM, each round decodes only a few ids of context plus the new ones: the
new text is the decode of ``ids[prefix:]`` minus the decode of ``ids[prefix:read]``,
where the context ids make the new ones decode as they do inside the whole text (a
leading space, a merged character).
New ids that end in an incomplete UTF-8 character stay unread, so the next round decodes
them again with the bytes that complete it. The text returned is always the decode of all
the ids (a unit test checks this with byte-level and real tokenizers).
"""

from __future__ import annotations

from collections.abc import Callable

CONTEXT_IDS = 5  # ids decoded again before the new ones
INCOMPLETE = "\ufffd"  # what a decoder makes of an incomplete UTF-8 character


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._text = ""  # the decode of ids[:read]
        self._prefix = 0  # ids[prefix:read] are decoded again as context
        self._read = 0

    def text(self, ids: list[int]) -> str:
        """The decode of ``ids``, which extend (or equal) the ids of the last call, or are
        shorter than them (it then starts over)."""
        if len(ids) < self._read:  # cut below what was read: start over
            self._text, self._prefix, self._read = "", 0, 0
        if len(ids) == self._read:
            return self._text
        context = self._decode(ids[self._prefix : self._read])
        if self._prefix < self._read and not context:  # special ids only: no context at all
            return self._reread(ids)  # (a decoder may strip the new text's leading space)
        tail = self._decode(ids[self._prefix :])
        if not tail.startswith(context):  # the new ids changed the context's text
            return self._reread(ids)
        new = tail[len(context) :]
        if new.endswith(INCOMPLETE):
            return self._text + new  # read these ids again once more bytes arrive
        self._text += new
        self._read = len(ids)
        self._prefix = max(0, self._read - CONTEXT_IDS)
        return self._text

    def _reread(self, ids: list[int]) -> str:
        text = self._decode(ids)
        if not text.endswith(INCOMPLETE):
            self._text, self._read = text, len(ids)
            self._prefix = max(0, self._read - CONTEXT_IDS)
        return text


__all__ = ["IncrementalDetokenizer"]
