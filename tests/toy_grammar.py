"""A toy Markov model over a tiny byte vocabulary with an end-of-generation token, and a
finite regular language over it, with the exact masked distribution of its replies."""

from __future__ import annotations

import numpy as np
from toy_models import ToyBackend

from tandem.runtime.backends.protocol import SpecialTokens
from tandem.runtime.constrained import GrammarState

PIECES = [b"a", b"b", b"ab", b"c", b"ba", b"d", b"ca", b""]
EOS = len(PIECES) - 1
REGEX = "[ab]cab[ab]{0,2}d"
"""After the first letter, ``cab`` is forced text (its canonical tokens ``ca`` ``b``)."""
LANGUAGE = {f"{x}cab{m}d" for x in "ab" for m in ["", "a", "b", "aa", "ab", "ba", "bb"]}


BYTES = [bytes([i]) for i in range(256)] + [b""]
"""A vocabulary that spells anything: every byte, then end-of-generation."""


class GrammarToy(ToyBackend):
    """A Markov toy whose tokens spell ``pieces`` (the last one, empty, ends generation)."""

    def __init__(self, table: np.ndarray, name: str = "toy", pieces: list[bytes] = PIECES) -> None:
        super().__init__(table, name)
        self.pieces = pieces

    @property
    def special(self) -> SpecialTokens:
        eos = len(self.pieces) - 1
        return SpecialTokens(bos=None, eos=eos, eog=frozenset({eos}))

    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]:
        data, out = text.encode(), []
        while data:
            best = max((i for i, p in enumerate(self.pieces) if p and data.startswith(p)),
                       key=lambda i: len(self.pieces[i]))
            out.append(best)
            data = data[len(self.pieces[best]):]
        return out

    def token_bytes(self, token: int) -> bytes:
        return self.pieces[token]


def exact_replies(table: np.ndarray, last: int, max_tokens: int, state: GrammarState) -> dict[tuple[int, ...], float]:
    """P(reply) under the model masked by ``state``'s masks and renormalised, walked
    exhaustively: replies end at end-of-generation (not included) or after
    ``max_tokens`` tokens."""
    out: dict[tuple[int, ...], float] = {}

    def walk(prefix: tuple[int, ...], prev: int, prob: float) -> None:
        state.follow(prefix)
        legal = list(np.flatnonzero(state.allowed()))
        if len(prefix) == max_tokens or legal == [EOS]:
            out[prefix] = out.get(prefix, 0.0) + prob
            return
        row = table[prev, legal] / table[prev, legal].sum()
        for t, p in zip(legal, row, strict=True):
            if p > 0 and t == EOS:
                out[prefix] = out.get(prefix, 0.0) + prob * p
            elif p > 0:
                walk((*prefix, int(t)), int(t), prob * p)

    walk((), last, 1.0)
    return out


def spelled(tokens: list[int]) -> str:
    return b"".join(PIECES[t] for t in tokens).decode()
