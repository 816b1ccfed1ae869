"""Text-level translation of a cross-vocabulary draft (UAG-style, exact for greedy).

Token-level maps (direct map + n-gram cache, :mod:`tandem.kernels.vocab_map`) only
propose a target token when the drafter happens to cut the text where the target does.
Two tokenizers trained differently rarely do: SentencePiece pieces carry *leading*
spaces (``▁there``) while the tinystories-656k BPE merged whole phrases with
*trailing* spaces (``there was a ``), so token-level translation almost never yields
the target's own token even when both models agree on the text.

Here the drafted *text* is re-tokenized with the target tokenizer instead (Hugging
Face's Universal Assisted Generation). To make the result continue the committed
target sequence, the text is encoded together with a look-behind window of committed
target tokens that starts on a committed token boundary; the encoding is used only when
it reproduces those committed tokens exactly, so its later tokens are what the target
tokenizer would write after them. When no window is consistent (the newest committed
token would merge with the drafted text, say ``the`` + ``re``), the drafted text is
encoded on its own, starting at the boundary.

Two rules keep the proposal honest:

* it never invents text: the tokens' bytes are always a prefix of the drafted text;
* the last re-tokenized tokens may still change when more text arrives (``ther`` +
  ``e`` becomes ``there was a ``), so the newest ``hold_back`` tokens are dropped unless
  the drafter ended the text (end of story).

Verification accepts a proposed token only when it equals the target's choice, so the
output is exactly the target's (greedy); under sampling the drafter drafts greedily,
the proposal is a deterministic function of the context and is verified with a one-hot
``q``, which the standard rejection rule also handles exactly (see ``xvocab``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.runtime.speculative.drafters.xvocab.vocab_pair import (
    Tokenizer,
    adds_space_prefix,
    complete_utf8_prefix,
)

LOOKBEHIND = (8, 4, 2, 1)
"""Committed target tokens tried as look-behind, longest first (the longest window
that re-encodes consistently is closest to how the whole text would be tokenized)."""


@dataclass
class TextProposal:
    """Target tokens for a drafted text, and the byte (in the drafted text) where each ends."""

    tokens: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    anchored: bool = False
    """True when a committed look-behind window confirmed the tokenization."""
    held_back: int = 0
    """Re-tokenized tokens dropped because they might still change."""


def strip_leading(ids: Sequence[int], pieces: Sequence[bytes], text: bytes) -> list[int] | None:
    """``ids`` without the tokens that spell bytes in front of ``text`` (a tokenizer's
    dummy space prefix), or ``None`` when they do not spell ``text`` after whole tokens."""
    decoded = b"".join(pieces[i] for i in ids)
    if not decoded.endswith(text):
        return None
    extra, pos = len(decoded) - len(text), 0
    for i, t in enumerate(ids):
        if pos == extra:
            return list(ids[i:])
        pos += len(pieces[t])
        if pos > extra:
            return None
    return [] if pos == extra else None


def token_ends(ids: Sequence[int], pieces: Sequence[bytes], start: int = 0) -> list[int]:
    """Cumulative byte end of each token, counted from ``start``."""
    out, pos = [], start
    for t in ids:
        pos += len(pieces[t])
        out.append(pos)
    return out


class TextTranslator:
    """Re-tokenizes drafted text with the target tokenizer, consistently with the
    committed target tokens."""

    def __init__(
        self, target: Tokenizer, pieces: Sequence[bytes], *, lookbehind: Sequence[int] = LOOKBEHIND,
        hold_back: int = 1,
    ) -> None:
        self.target = target
        self.pieces = list(pieces)
        self.space_prefix = adds_space_prefix(target, self.pieces)
        self.lookbehind = tuple(sorted(set(lookbehind), reverse=True))
        self.hold_back = hold_back
        self._units = encodable_units(self.pieces)
        self.calls = 0
        """Target ``tokenize`` calls made (telemetry: this is the per-round overhead)."""

    def encodable(self, text: str) -> int:
        """Length of the longest prefix of ``text`` the target tokenizer can encode.

        llama.cpp *aborts the process* (``unordered_map::at``) when a SentencePiece
        vocabulary without byte-fallback tokens meets a character it lacks (the 656k
        vocabulary has no ``é``), so only characters that are tokens themselves, or whose
        every byte is one, are ever handed to it."""
        return encodable_prefix(text, self._units)

    def encode_exact(self, text: bytes) -> list[int] | None:
        """Target tokens spelling exactly ``text`` (no dummy prefix), or ``None``.

        A tokenizer that prepends a space (SentencePiece's dummy prefix) is handed the
        text without its leading space when it has one, so that the prepended space
        stands for it; otherwise the prepended space's tokens are cut off, which works
        only when they form whole tokens.
        """
        if not text or complete_utf8_prefix(text) != len(text):
            return None
        s = text.decode("utf-8")
        if self.encodable(s) != len(s):
            return None
        tries = [s[1:], s] if self.space_prefix and s.startswith(" ") and len(s) > 1 else [s]
        for candidate in tries:
            self.calls += 1
            ids = strip_leading(self.target.tokenize(candidate, add_bos=False), self.pieces, text)
            if ids:
                return ids
        return None

    def propose(self, context: Sequence[int], drafted: bytes, *, final: bool = False) -> TextProposal:
        """Target tokens continuing ``context`` with (a prefix of) the ``drafted`` text."""
        usable = max(complete_utf8_prefix(drafted), 0)
        decoded = drafted[:usable].decode("utf-8")
        text = decoded[: self.encodable(decoded)].encode("utf-8")
        usable = len(text)
        if not text:
            return TextProposal()
        first_text = _first_text_token(context, self.pieces)
        anchored = False
        new: list[int] | None = None
        for n in self.lookbehind:
            a = len(context) - n
            if a < first_text:
                continue
            behind = list(context[a:])
            window = b"".join(self.pieces[t] for t in behind)
            if complete_utf8_prefix(window) != len(window):
                continue
            ids = self.encode_exact(window + text)
            if ids is not None and ids[: len(behind)] == behind and len(ids) > len(behind):
                new, anchored = ids[len(behind) :], True
                break
        if new is None:
            new = self.encode_exact(text) or []
        keep = len(new) if final and usable == len(drafted) else max(len(new) - self.hold_back, 0)
        return TextProposal(new[:keep], token_ends(new[:keep], self.pieces), anchored, len(new) - keep)


def _first_text_token(context: Sequence[int], pieces: Sequence[bytes]) -> int:
    """Index after the last committed token that spells no text (BOS, control tokens):
    a look-behind window must not reach across one."""
    for i in range(len(context) - 1, -1, -1):
        if not pieces[context[i]]:
            return i + 1
    return 0


def encodable_prefix(text: str, units: tuple[frozenset[str], frozenset[int]]) -> int:
    """Length of the prefix of ``text`` whose every character is a token, or has every
    byte a token (see :meth:`TextTranslator.encodable`)."""
    chars, single = units
    for i, ch in enumerate(text):
        if ch not in chars and not all(b in single for b in ch.encode("utf-8")):
            return i
    return len(text)


def encodable_units(pieces: Sequence[bytes]) -> tuple[frozenset[str], frozenset[int]]:
    """Characters that are whole tokens, and bytes that are whole tokens."""
    chars, single = set(), set()
    for p in pieces:
        if len(p) == 1:
            single.add(p[0])
        if 0 < len(p) <= 4 and complete_utf8_prefix(p) == len(p):
            s = p.decode("utf-8")
            if len(s) == 1:
                chars.add(s)
    return frozenset(chars), frozenset(single)
