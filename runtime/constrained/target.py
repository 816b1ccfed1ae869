"""The target as every strategy sees it under a grammar: logits masked to legal tokens.

:class:`MaskedTarget` is a :class:`~tandem.runtime.backends.protocol.Backend` around the
real target. Each logits row it returns that predicts a token of the reply has every
illegal token at -inf, under the grammar state after the tokens before that row — in a
verify call over a draft too, row by row. Plain decoding, every speculative strategy and
every sampler then read one and the same masked distribution: greedy takes the argmax of
the masked logits, sampling (and speculative acceptance, which uses the sampler's own
distribution as p) the model's probabilities renormalised to the legal tokens. So
constrained speculative decoding is lossless exactly as unconstrained decoding is.

Rows past an illegal token (a timing pad, a draft not cut) are returned unmasked: the
row that predicted that token gave it probability 0, so verification rejects it there
and never reads a row after it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tandem.runtime.backends.protocol import Backend, ComputeSettings, MemoryReport, SpecialTokens
from tandem.runtime.constrained.state import GrammarState


class MaskedTarget:
    """``target`` with its logits masked by ``state``, the reply starting after
    ``prompt_len`` cached tokens."""

    def __init__(self, target: Backend, state: GrammarState, prompt_len: int) -> None:
        self.inner = target
        self.state = state
        self.prompt_len = prompt_len
        self.name = target.name

    # -- masking --------------------------------------------------------------------------
    def _reply(self, tokens: Sequence[int]) -> list[int]:
        return list(tokens[self.prompt_len:])

    def evaluate(self, tokens: Sequence[int], logits_for: Sequence[int] | None = None) -> np.ndarray:
        tokens = list(tokens)
        start = len(self.inner.tokens)
        legal = self.state.follow(self._reply(self.inner.tokens))
        rows = self.inner.evaluate(tokens, logits_for)
        wanted = [len(tokens) - 1] if logits_for is None else list(logits_for)
        order = sorted(range(len(wanted)), key=wanted.__getitem__)
        out = np.array(rows, dtype=np.float32, copy=True)
        broken = legal < max(0, start - self.prompt_len)  # an illegal token already cached
        fed = 0  # tokens[:fed] are behind the state
        for r in order:
            j = wanted[r]
            while fed <= j and not broken:  # move the state past tokens[j]
                if start + fed >= self.prompt_len:
                    if not self.state.allowed()[tokens[fed]]:
                        broken = True
                        break
                    self.state.consume(tokens[fed:fed + 1])
                fed += 1
            if broken:
                break
            if start + j + 1 >= self.prompt_len:  # this row predicts a reply token
                out[r] = self.state.mask(out[r])
        return out

    def truncate(self, n: int) -> None:
        self.inner.truncate(n)
        keep = max(0, n - self.prompt_len)
        if len(self.state.tokens) > keep:
            self.state.rollback(len(self.state.tokens) - keep)

    # -- the rest of the protocol, as the target answers it ----------------------------------
    @property
    def n_vocab(self) -> int:
        return self.inner.n_vocab

    @property
    def n_ctx(self) -> int:
        return self.inner.n_ctx

    @property
    def special(self) -> SpecialTokens:
        return self.inner.special

    @property
    def tokens(self) -> list[int]:
        return self.inner.tokens

    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]:
        return self.inner.tokenize(text, add_bos=add_bos, special=special)

    def token_bytes(self, token: int) -> bytes:
        return self.inner.token_bytes(token)

    def chat_template(self) -> str | None:
        return self.inner.chat_template()

    def keep_spans(self, spans: Sequence[tuple[int, int]]) -> bool:
        moved = self.inner.keep_spans(spans)
        if moved:
            self.state.follow(self._reply(self.inner.tokens))
        return moved

    @property
    def exact_batch(self) -> int | None:
        return self.inner.exact_batch

    def memory(self) -> MemoryReport:
        return self.inner.memory()

    def compute_settings(self) -> ComputeSettings:
        return self.inner.compute_settings()

    def set_threads(self, n: int) -> bool:
        return self.inner.set_threads(n)

    def close(self) -> None:
        """The target belongs to its opener: a request's view never closes it."""
