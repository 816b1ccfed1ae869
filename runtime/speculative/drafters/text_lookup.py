"""Prompt lookup on text: drafts for a reply that copies the prompt inside new syntax.

Token prompt lookup (:mod:`.lookup`) needs the reply's last tokens to be tokens the prompt
had. A reply that quotes the prompt where the syntax around it changes breaks that: in
"Priya Raman, 41" the name is ``[" Pri", "ya", " Ram", "an"]``, and the same name as a
JSON value after ``"`` is ``["Pri", "ya", " Ram", "an"]`` — the first token differs, so the
n-gram that ends with it is nowhere in the prompt. Matching bytes instead finds it: the
longest suffix of the context's text that occurred earlier, and the text that followed
it there, tokenized as the target tokenizes text.

An extraction under a schema (:mod:`tandem.runtime.constrained`) is mostly such values
between forced syntax, which is where this drafter is asked first. Like every model-free
drafter it proposes one-hot tokens, so verification stays exact, and it costs no model
call: a byte search over the context and one tokenization of a short span.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Protocol

from tandem.kernels.sampling import Sampler
from tandem.runtime.speculative.drafters.base import Draft, ModelFreeDrafter


class TextCodec(Protocol):
    """The two tokenizer calls this drafter needs (a :class:`~tandem.runtime.backends.protocol.Backend` has both)."""

    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]: ...

    def token_bytes(self, token: int) -> bytes: ...


def longest_earlier_match(text: bytes, min_len: int, max_len: int) -> tuple[int, int] | None:
    """``(length, end)`` of the longest suffix of ``text`` (``min_len`` to ``max_len``
    bytes) that also occurs earlier, ending before ``text`` does (so something follows
    it); ``end`` is where its most recent such occurrence ends. ``None`` when even the
    shortest suffix never occurred. A suffix that never occurred has no longer one that
    did, so the search stops at the first miss."""
    best = None
    for n in range(min_len, min(max_len, len(text) - 1) + 1):
        start = text.rfind(text[-n:], 0, len(text) - 1)
        if start < 0:
            break
        best = (n, start + n)
    return best


_CLAUSE_END = re.compile(rb"[,;.!?)\]}]\s|\s[(\[{]|\n")


def _is_word_byte(byte: int) -> bool:
    """A letter, a digit, or part of a non-ASCII character."""
    return byte >= 0x80 or chr(byte).isalnum()


def clause_head(text: bytes) -> bytes:
    """``text`` up to the end of its clause: a value copied from a sentence ("Lyon" from
    "Lyon, France", "Anna Vogel" from "Anna Vogel (anna@...") ends where the sentence's
    punctuation does, while "89.50" and "anna@rustberlin.org" go on (no space after
    their dots)."""
    end = _CLAUSE_END.search(text)
    return text if end is None else text[: end.start()]


CONFIDENCE = 0.85
"""The first drafted token's chance of acceptance, as measured on the 1.5B's greedy
replies to the structured bench's prompts: a copied value continued in the middle of a
word (20 drafts: the first token accepted in 17). The match's length says little here:
the longest matches are whole values, after which the reply closes its quote where the
prompt goes on. Adaptive policies calibrate it against what is accepted."""

DECAY = 0.93
"""Each further token's chance, given the ones before it, falls by this factor: a value
ends where the prompt's sentence goes on (measured: 0.85, 0.80, 0.80, 0.57, 0.67, ...)."""


def confidences(n: int) -> list[float]:
    """Per-token conditional acceptance estimates for a draft of ``n`` tokens."""
    return [CONFIDENCE * DECAY**i for i in range(n)]


class TextLookupDrafter(ModelFreeDrafter):
    """Drafts the text that followed the longest earlier occurrence of the context's last
    ``min_match``-``max_match`` bytes, up to ``span`` bytes of it, as tokens."""

    def __init__(self, codec: TextCodec, *, min_match: int = 2, max_match: int = 32, span: int = 48) -> None:
        if not 1 <= min_match <= max_match:
            raise ValueError("need 1 <= min_match <= max_match")
        self.name = "text-lookup"
        self.codec = codec
        self.min_match = min_match
        self.max_match = max_match
        self.span = span
        self._tokens: list[int] = []
        self._text = bytearray()

    def _sync(self, context: Sequence[int]) -> bytes:
        """The context's text, extended by the tokens new since the last call."""
        n = len(self._tokens)
        if len(context) < n or list(context[:n]) != self._tokens:
            self._tokens, self._text = [], bytearray()
        for token in context[len(self._tokens):]:
            self._text += self.codec.token_bytes(token)
        self._tokens = list(context)
        return bytes(self._text)

    def propose(self, context: Sequence[int], max_tokens: int, sampler: Sampler) -> Draft:
        if max_tokens <= 0:
            return Draft([], None, self.name)
        text = self._sync(context)
        if not text or not _is_word_byte(text[-1]):
            return Draft([], None, self.name)  # between words: what follows is the reply's choice
        found = longest_earlier_match(text, self.min_match, self.max_match)
        if found is None:
            return Draft([], None, self.name)
        _, end = found
        following = clause_head(text[end:end + self.span])
        if not following:
            return Draft([], None, self.name)
        tokens = self.codec.tokenize(following.decode("utf-8", errors="ignore"))
        if len(following) == self.span and len(tokens) > 1:
            tokens = tokens[:-1]  # the span may have cut its last word: that token is a guess
        tokens = tokens[:max_tokens]
        return Draft(tokens, None, self.name, confidences(len(tokens)))

    def close(self) -> None:
        self._tokens, self._text = [], bytearray()
