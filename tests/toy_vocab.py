"""Toy cross-vocabulary models: two partly overlapping byte vocabularies and a Markov
model whose tokens spell them (shared by the cross-vocabulary tests)."""

from __future__ import annotations

import numpy as np
from toy_models import ToyBackend

DRAFT_PIECES = [b"a", b"b", b"e", b"ab", b"ba", b"c", b"a", b"?"]
TARGET_PIECES = [b"a", b"b", b"c", b"ab", b"d", b"cd"]


class PieceToy(ToyBackend):
    """A toy Markov model whose tokens spell given byte pieces (greedy longest-match tokenizer)."""

    def __init__(self, table: np.ndarray, pieces: list[bytes], name: str) -> None:
        super().__init__(table, name)
        self.pieces = pieces

    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]:
        data, out = text.encode(), []
        while data:
            fits = [i for i, p in enumerate(self.pieces) if data.startswith(p)]
            if not fits:  # an unknown byte: the tokenizer's '?' (so the text cannot round-trip)
                out.append(self.pieces.index(b"?") if b"?" in self.pieces else 0)
                data = data[1:]
                continue
            best = max(fits, key=lambda i: (len(self.pieces[i]), -i))
            out.append(best)
            data = data[len(self.pieces[best]) :]
        return out

    def token_bytes(self, token: int) -> bytes:
        return self.pieces[token]
