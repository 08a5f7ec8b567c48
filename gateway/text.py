"""Incremental detokenization with stop strings: text deltas safe to stream, cut before a stop string."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"  # what a decoder shows for an incomplete UTF-8 sequence


@dataclass
class TextDelta:
    text: str  # new text to send
    stopped: bool  # a stop string was found; text ends just before it


class TextStream:
    """Decode the growing output and emit only text that cannot change or turn out to start a stop string."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()):
        self._decode = decode
        self._stop = tuple(stop)
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self._token_ids: list[int] = []
        self._text = ""
        self._sent = 0  # characters already emitted

    @property
    def text(self) -> str:
        return self._text

    def push(self, token_ids: Sequence[int]) -> TextDelta:
        """Add tokens; return the text that became final."""
        self._token_ids.extend(token_ids)
        self._text = self._decode(self._token_ids)
        cut = self._first_stop()
        if cut is not None:
            self._text = self._text[:cut]
            return TextDelta(self._take(len(self._text)), stopped=True)
        stable = len(self._text.rstrip(REPLACEMENT_CHAR))
        return TextDelta(self._take(min(stable, len(self._text) - self._holdback)), stopped=False)

    def flush(self) -> str:
        """At the end: everything not yet sent."""
        return self._take(len(self._text))

    def _first_stop(self) -> int | None:
        start = max(0, self._sent - self._holdback)
        found = [i for i in (self._text.find(s, start) for s in self._stop) if i >= 0]
        return min(found) if found else None

    def _take(self, end: int) -> str:
        if end <= self._sent:
            return ""
        piece, self._sent = self._text[self._sent : end], end
        return piece
