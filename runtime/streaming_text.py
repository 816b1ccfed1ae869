"""Streaming text: UTF-8-safe incremental detokenization and stop-string matching."""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence


def tokens_text(token_bytes: Callable[[int], bytes], tokens: Sequence[int]) -> str:
    """The text of a whole token sequence, as a reply writes it (control tokens add nothing;
    bytes that are not whole UTF-8 characters become U+FFFD)."""
    return b"".join(token_bytes(t) for t in tokens).decode("utf-8", errors="replace")


class Detokenizer:
    """Turns a stream of token ids into text without ever splitting a character.

    Byte-level tokenizers emit multi-byte characters across several tokens; an
    incremental UTF-8 decoder holds partial bytes until the character is complete.
    """

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        self._token_bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, tokens: Sequence[int]) -> str:
        return self._decoder.decode(b"".join(self._token_bytes(t) for t in tokens))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class StopMatcher:
    """Finds stop strings in streamed text, holding back text that may start one.

    ``feed`` returns the text that is safe to show and whether a stop string was hit;
    on a hit the returned text ends just before the stop string.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._pending = ""
        self.hit = ""
        """The stop string found (the first in the text), once one is."""

    def feed(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        buf = self._pending + text
        hits = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            self._pending = ""
            at, self.hit = min(hits, key=lambda h: h[0])
            return buf[:at], True
        hold = max((_overlap(buf, s) for s in self.stops), default=0)
        self._pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``stop``."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
