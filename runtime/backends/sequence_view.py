"""One sequence of a shared llama.cpp context as a full
:class:`~tandem.runtime.backends.protocol.Backend`: a server slot. Its requests go through
the :class:`~tandem.runtime.backends.llama_batch.SequenceBatcher`, which decodes them with
the other slots' (the module that says how and why every slot stays lossless)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np

from tandem.errors import TandemError
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_batch import Request, SequenceBatcher
from tandem.runtime.backends.protocol import (
    ComputeSettings,
    MemoryReport,
    SpecialTokens,
    check_room,
    chunked_logits,
)
from tandem.runtime.backends.token_cache import new_tokens

PREFILL_CHUNK = 16
"""Rows per decode of a slot's long request (a prompt) once an editor uses the context
(:meth:`~tandem.runtime.backends.llama_batch.SequenceBatcher.chunks_prompts`): a multiple
of the repacked kernels' 4-row groups, at least the 8 rows from which llama.cpp's CPU
matmul takes one kernel path (see :mod:`~tandem.runtime.backends.llama_batch`; ``tests/runtime/backends/
test_llama_batch.py`` checks the identity on the real models on every machine it runs on)."""

CHUNK_MIN = 8
"""Fewest rows in a chunk: from 8 rows on, llama.cpp's CPU matmul keeps one kernel path."""

CHUNK_ALIGN = 4
"""Every chunk but the last holds whole groups of the repacked kernels' 4 rows, so the rows
left over for the one-by-one kernel are the ones the whole batch leaves over."""


class SequenceView:
    """One sequence of a shared context, as a :class:`Backend` (and ``EmbeddingInput``,
    ``RowSource``): its own ``tokens``, evaluation through the batcher. The base backend
    (model, vocabulary, context) is owned and closed by whoever opened it."""

    def __init__(self, batcher: SequenceBatcher, seq: int) -> None:
        self.batcher = batcher
        self.seq = seq
        self.base = batcher.base
        self.name = self.base.name
        self._tokens: list[int] = []

    # -- what the base answers for every sequence ---------------------------------------
    @property
    def n_vocab(self) -> int:
        return self.base.n_vocab

    @property
    def n_ctx(self) -> int:
        return self.base.n_ctx

    @property
    def special(self) -> SpecialTokens:
        return self.base.special

    @property
    def tokens(self) -> list[int]:
        return list(self._tokens)

    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]:
        return self.base.tokenize(text, add_bos=add_bos, special=special)

    def token_bytes(self, token: int) -> bytes:
        return self.base.token_bytes(token)

    def chat_template(self) -> str | None:
        return self.base.chat_template()

    @property
    def exact_batch(self) -> int | None:
        return self.base.exact_batch

    def memory(self) -> MemoryReport:
        """The whole context's bytes (weights and every sequence's KV are shared)."""
        return self.base.memory()

    def compute_settings(self) -> ComputeSettings:
        return self.base.compute_settings()

    def set_threads(self, n: int) -> bool:
        return self.base.set_threads(n)

    def close(self) -> None:
        """Nothing of its own to free: the context belongs to the base backend."""

    # -- this sequence's cache ----------------------------------------------------------
    def evaluate(self, tokens: Sequence[int], logits_for: Sequence[int] | None = None) -> np.ndarray:
        ids = new_tokens(tokens)
        return self._evaluate(len(ids), logits_for, ids, None)

    def _evaluate(self, n: int, logits_for: Sequence[int] | None, ids: list[int] | None,
                  embeds: np.ndarray | None) -> np.ndarray:
        check_room(len(self._tokens), n, self.n_ctx)

        def run(start: int, stop: int, rows: list[int]) -> np.ndarray:
            req = Request(self.seq, len(self._tokens), None if ids is None else ids[start:stop],
                          None if embeds is None else embeds[start:stop], rows)
            out = self.batcher.decode(req)
            self._tokens.extend(ids[start:stop] if ids is not None else [-1] * (stop - start))
            return out

        step, min_last, align = ((PREFILL_CHUNK, CHUNK_MIN, CHUNK_ALIGN) if self.batcher.chunks_prompts(self.seq)
                                 else (self.base.n_batch, 1, 1))
        return self.base.checked_logits(chunked_logits(n, step, self.n_vocab, logits_for, run,
                                                       min_last=min_last, align=align, fresh=True))

    def truncate(self, n: int) -> None:
        n = max(0, n)
        if n >= len(self._tokens):
            return
        if not self.batcher.seq_rm(self.seq, n):
            raise TandemError("This model's cache cannot drop a suffix of one sequence; serve it with --parallel 1.")
        del self._tokens[n:]

    def keep_spans(self, spans: Sequence[tuple[int, int]]) -> bool:
        if not spans or not self.batcher.seq_move(self.seq, spans):
            return False
        self._tokens = [t for start, end in spans for t in self._tokens[start:end]]
        return True

    # -- superposed input -----------------------------------------------------------------
    @property
    def n_embd(self) -> int:
        return self.base.n_embd

    def token_embeddings(self) -> np.ndarray:
        return self.base.token_embeddings()

    def token_embedding_rows(self, ids: Sequence[int]) -> np.ndarray:
        return self.base.token_embedding_rows(ids)

    def evaluate_embeddings(self, embeds: np.ndarray, logits_for: Sequence[int] | None = None) -> np.ndarray:
        embeds = np.ascontiguousarray(np.atleast_2d(embeds), dtype=np.float32)
        if embeds.shape[0] == 0 or embeds.shape[1] != self.n_embd:
            raise ValueError(f"evaluate_embeddings needs rows of width {self.n_embd}, got shape {embeds.shape}")
        return self._evaluate(embeds.shape[0], logits_for, None, embeds)

    # -- scheduling -------------------------------------------------------------------------
    @contextlib.contextmanager
    def engaged(self, urgent: bool = False) -> Iterator[None]:
        """While a job runs on this slot: the batcher waits for its next step before
        decoding others (see the module docstring); released when the job ends. An
        ``urgent`` slot (an editor waiting) has the context to itself until it
        settles (:meth:`settle`) or the job ends."""
        self.batcher.engage(self.seq, urgent)
        try:
            yield
        finally:
            self.batcher.release(self.seq)

    def interrupt(self) -> None:
        """This slot's job was stopped: the step it waits for is withdrawn (see
        :meth:`~tandem.runtime.backends.llama_batch.SequenceBatcher.interrupt`)."""
        self.batcher.interrupt(self.seq)

    def settle(self) -> None:
        """This slot's urgent part is over (its user has the first token): the other
        slots decode again, with its steps merged into theirs."""
        self.batcher.settle(self.seq)


def open_views(base: LlamaCppBackend) -> SequenceBatcher:
    """A batcher over ``base``'s sequences (``base`` opened with ``LlamaConfig.n_seq``)."""
    if base.n_seq < 2:
        raise ValueError("parallel sequences need a context opened with n_seq >= 2")
    batcher = SequenceBatcher(base)
    batcher.views = [SequenceView(batcher, s) for s in range(base.n_seq)]
    return batcher
