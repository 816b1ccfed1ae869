"""Vocabulary pairs built from backends: pieces, direct map, text alignment helpers.

The pure mapping lives in :mod:`tandem.kernels.vocab_map`; this module reads what it
needs from anything with the tokenizer half of the ``Backend`` protocol
(``tokenize``, ``token_bytes``, ``n_vocab``, ``special``), so a backend or a
tokenizer-only :meth:`tandem.runtime.backends.llama_vocab.LlamaVocab.open` serves, and
cross-vocabulary code can be exercised against real tokenizers without weights.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import numpy as np

from tandem.kernels.vocab_map import build_direct_map
from tandem.runtime.backends.protocol import SpecialTokens


class Tokenizer(Protocol):
    """The tokenizer half of :class:`tandem.runtime.backends.protocol.Backend`."""

    name: str

    @property
    def n_vocab(self) -> int: ...

    @property
    def special(self) -> SpecialTokens: ...

    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]: ...

    def token_bytes(self, token: int) -> bytes: ...


def pieces_of(tok: Tokenizer) -> list[bytes]:
    """Every token's output bytes, in id order."""
    return [tok.token_bytes(i) for i in range(tok.n_vocab)]


def adds_space_prefix(tok: Tokenizer, pieces: list[bytes] | None = None) -> bool:
    """Whether tokenizing ``"a"`` yields ``" a"`` (SentencePiece's dummy prefix)."""
    pieces = pieces or pieces_of(tok)
    return b"".join(pieces[i] for i in tok.tokenize("a")) == b" a"


def complete_utf8_prefix(data: bytes) -> int:
    """Length of the longest prefix of ``data`` that ends on a character boundary,
    or -1 when ``data`` is not valid UTF-8 apart from an unfinished last character."""
    dec = codecs.getincrementaldecoder("utf-8")(errors="strict")
    try:
        text = dec.decode(data, final=False)
    except UnicodeDecodeError:
        return -1
    return len(text.encode("utf-8"))


@dataclass
class VocabPair:
    """A drafter vocabulary and a target vocabulary, with the direct map between them."""

    draft_pieces: list[bytes]
    target_pieces: list[bytes]
    direct: np.ndarray
    draft_space_prefix: bool

    @classmethod
    def build(cls, drafter: Tokenizer, target: Tokenizer) -> VocabPair:
        dp, tp = pieces_of(drafter), pieces_of(target)
        ds, ts = drafter.special, target.special
        specials: list[tuple[int, int]] = []
        if ts.eos is not None:
            specials += [(d, ts.eos) for d in sorted(ds.eog | ({ds.eos} if ds.eos is not None else set()))]
        direct = build_direct_map(dp, tp, special_pairs=specials)
        return cls(dp, tp, direct, adds_space_prefix(drafter, dp))

    @cached_property
    def shared(self) -> int:
        """Number of drafter ids with a target counterpart."""
        return int(np.count_nonzero(self.direct >= 0))

    def draft_text(self, ids: list[int]) -> bytes:
        return b"".join(self.draft_pieces[i] for i in ids)

    def target_text(self, ids: list[int]) -> bytes:
        return b"".join(self.target_pieces[i] for i in ids)
