"""A bound on the digits of a JSON number, so a model pushing against a schema stops.

A model that wants to go on where a schema says stop (another key after ``{"x": 1``,
where the object holds only ``x``) has only digits left among its legal tokens, and it
may write them until the reply runs out of tokens: ``{"x": 1.2345678901234567890...``,
no JSON at all. Seen on the real 1.5B with ``"Give me a sample record."`` under a
one-key schema. llama.cpp's JSON-schema grammars bound each part of a number (integer,
fraction, exponent) to :data:`MAX_DIGITS` digits; so does Tandem, as a mask over
llguidance's: past the bound the number must end or go on to its next part.

The state here is a small lexer over the reply's bytes (inside a string or not, and how
many digits end it); :func:`digit_room` turns it into the tokens the bound allows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MAX_DIGITS = 16
"""Digits one part of a number may hold (llama.cpp's bound for integer and fraction)."""

_DIGITS = frozenset(b"0123456789")


@dataclass(frozen=True)
class JsonLex:
    """Where a JSON text stands: inside a string (and after a backslash there), and how
    many digits end it outside a string (the part of a number being written)."""

    in_string: bool = False
    escaped: bool = False
    digits: int = 0

    def after(self, piece: bytes) -> JsonLex:
        in_string, escaped, digits = self.in_string, self.escaped, self.digits
        for byte in piece:
            if in_string:
                if escaped:
                    escaped = False
                elif byte == 0x5C:  # backslash
                    escaped = True
                elif byte == 0x22:  # closing quote
                    in_string = False
            elif byte == 0x22:
                in_string, digits = True, 0
            elif byte in _DIGITS:
                digits += 1
            else:
                digits = 0
        return JsonLex(in_string, escaped, digits)


def leading_digits(pieces: Sequence[bytes]) -> np.ndarray:
    """Per token, how many digits its bytes begin with (at most 255)."""
    lead = np.zeros(len(pieces), dtype=np.uint8)
    for token, piece in enumerate(pieces):
        n = 0
        while n < len(piece) and piece[n] in _DIGITS:
            n += 1
        lead[token] = min(n, 255)
    return lead


def digit_room(lex: JsonLex, lead: np.ndarray) -> np.ndarray | None:
    """The tokens that keep the number being written within :data:`MAX_DIGITS` digits a
    part (``None``: no bound applies here, inside a string)."""
    if lex.in_string:
        return None
    return lead <= MAX_DIGITS - min(lex.digits, MAX_DIGITS)
