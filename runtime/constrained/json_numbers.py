"""A bound on the digits of a JSON number, so a model pushing against a schema stops.

A model that wants to go on where a schema says stop (another key after ``{"x": 1``,
where the object holds only ``x``) has only digits left among its legal tokens, and it
may write them until the reply runs out of tokens: ``{"x": 1.2345678901234567890...``,
no JSON at all. Seen on the real 1.5B with ``"Give me a sample record."`` under a
one-key schema. llama.cpp's JSON-schema grammars bound each part of a number (integer,
fraction, exponent) to :data:`MAX_DIGITS` digits; so does Tandem, as a mask over
llguidance's: past the bound the number must end or go on to its next part.

Where the schema will not let the number end there (``multipleOf``: under
``multipleOf: 7`` the integer ``1777777777777777`` is no multiple, and no run of sevens
after it makes one; a lower bound that needs more digits), the state searches the
shortest runs of digits after which it may, and allows only their first digits
(:meth:`~.state.GrammarState.allowed`): the number ends at most :data:`MAX_OVERRUN`
digits past the bound. Dropping the bound there instead let a model that likes sevens
write them until ``max_tokens`` (seen on the real 0.5B). A ``multipleOf`` whose way out
can be longer is refused when the schema compiles (:func:`unbounded_multiples`).

The state here is a small lexer over the reply's bytes (inside a string or not, and how
many digits end it); :func:`digit_room` turns it into the tokens the bound allows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

MAX_DIGITS = 16
"""Digits one part of a number may hold (llama.cpp's bound for integer and fraction)."""

MAX_OVERRUN = 4
"""Digits a part may take past :data:`MAX_DIGITS` where the schema lets it end no
sooner. The search for the way out tries every run of digits up to this length (11,110
grammar masks at most: 0.34 s on Qwen2.5's 152k vocabulary, only for a number that
overran under a multipleOf near 10,000; a few milliseconds under ``multipleOf: 7``)."""

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


def digit_tokens(pieces: Sequence[bytes]) -> tuple[int, ...]:
    """One token per decimal digit, spelling that digit alone (the first such token): the
    steps of the search past the bound (a vocabulary with byte tokens has two of some
    digits; trying both would only double the search)."""
    first: dict[bytes, int] = {}
    for token, piece in enumerate(pieces):
        if len(piece) == 1 and piece[0] in _DIGITS:
            first.setdefault(piece, token)
    return tuple(first[d] for d in sorted(first))


def bounded_multiple(value: object) -> bool:
    """Whether every number under ``multipleOf: value`` can end within
    :data:`MAX_OVERRUN` digits past the bound, wherever the model took it.

    An integer is a multiple of ``p/q`` (lowest terms) when ``p`` divides it, and the
    ``L`` digits written after an integer part reach every remainder modulo ``p`` once
    ``10**L >= p``: so ``p <= 10**MAX_OVERRUN``. The same holds for a fraction part still
    short of the grid of ``multipleOf`` (its digits scaled to an integer); one past the
    grid is a multiple already, as only zeros may follow a digit there. Values that are
    no finite number are left to llguidance to refuse."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return True
    return Fraction(str(value)).numerator <= 10**MAX_OVERRUN


_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
"""Keywords whose values are JSON data, not schemas (a ``multipleOf`` there is data)."""
_NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
"""Keywords whose values map names to schemas (a property may be named ``multipleOf``)."""


def unbounded_multiples(schema: Any) -> tuple[Any, list[float]]:
    """``schema`` without the ``multipleOf`` keywords :func:`bounded_multiple` refuses,
    and their values: a strict schema with any is refused, a lenient one (``strict:
    false``) ignores them as it ignores every keyword the grammar cannot enforce."""
    found: list[float] = []
    return _without_unbounded(schema, found), found


def _without_unbounded(node: Any, found: list[float], named: bool = False) -> Any:
    if isinstance(node, list):
        return [_without_unbounded(item, found) for item in node]
    if not isinstance(node, dict):
        return node
    if named:
        return {name: _without_unbounded(sub, found) for name, sub in node.items()}
    out = {}
    for key, value in node.items():
        if key in _DATA_KEYWORDS:
            out[key] = value
        elif key == "multipleOf" and not bounded_multiple(value):
            found.append(value)
        else:
            out[key] = _without_unbounded(value, found, named=key in _NAMED_SCHEMAS)
    return out
