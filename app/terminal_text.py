"""Model text made safe to show on a terminal.

A model (or a stored reply, or a prompt echoed back) can produce terminal control
sequences: an OSC that retitles the window or writes the clipboard, a CSI that moves
the cursor or clears the screen, a bare carriage return that overwrites a line. Before
model text reaches a terminal (``tandem run``, the chat app) every escape sequence and
every C0/C1 control character except newline and tab is removed. JSON output and the
database keep the text verbatim: only what is *displayed* is cleaned.
"""

from __future__ import annotations

import re

_COMPLETE = (
    r"\x1b\[[0-?]*[ -/]*[@-~]"  # CSI ... final byte
    r"|\x1b\][^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)"  # OSC ... BEL or ST
    r"|\x1b[PX^_][^\x1b\x9c]*(?:\x1b\\|\x9c)"  # DCS, SOS, PM, APC ... ST
    r"|\x1b[ -/]*[0-OQ-WYZ\\`-~]"  # other escapes (charset selection, keypad modes, RIS, ...)
    r"|\x9b[0-?]*[ -/]*[@-~]"  # 8-bit CSI
    r"|[\x90\x98\x9d\x9e\x9f][^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)"  # 8-bit DCS/SOS/OSC/PM/APC
)
_PARTIAL = (
    r"\x1b[ -/]*\Z"
    r"|\x1b\[[0-?]*[ -/]*\Z"
    r"|\x1b\][^\x07\x1b\x9c]*\x1b?\Z"
    r"|\x1b[PX^_][^\x1b\x9c]*\x1b?\Z"
    r"|\x9b[0-?]*[ -/]*\Z"
    r"|[\x90\x98\x9d\x9e\x9f][^\x07\x1b\x9c]*\x1b?\Z"
)
_SEQUENCE = re.compile(_COMPLETE)
_SEQUENCE_OR_TAIL = re.compile(f"(?:{_COMPLETE})|(?P<tail>{_PARTIAL})")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
"""C0 controls except tab and newline, DEL, and the C1 range."""
MAX_PENDING = 4096
"""An unfinished sequence longer than this is not a sequence: release it (cleaned)."""


def strip_controls(text: str) -> str:
    """``text`` without escape sequences and control characters (``\\n`` and ``\\t`` stay)."""
    return _CONTROL.sub("", _SEQUENCE.sub("", text))


class StreamCleaner:
    """:func:`strip_controls` for text that arrives in fragments: a sequence split across
    fragments (ESC at the end of one, ``]0;title`` at the start of the next) is held
    back until it is complete, so no part of it leaks through as text or as control."""

    def __init__(self) -> None:
        self._pending = ""

    def feed(self, fragment: str) -> str:
        text = self._pending + fragment
        self._pending = ""
        tail = None
        for m in _SEQUENCE_OR_TAIL.finditer(text):
            if m.group("tail") is not None:
                tail = m
        if tail is not None and len(text) - tail.start() <= MAX_PENDING:
            self._pending = text[tail.start():]
            text = text[: tail.start()]
        return strip_controls(text)

    def flush(self) -> str:
        """What is still held back (an unfinished sequence at the very end), cleaned."""
        out, self._pending = strip_controls(self._pending), ""
        return out


def mask_controls(text: str) -> str:
    """Each control character replaced by U+FFFD: safe to show, and every other
    character keeps its offset (for views that colour character spans)."""
    return _CONTROL.sub("\ufffd", text)
