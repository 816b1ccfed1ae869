"""The superposed decoder: k drafts from one forward pass per step, on any backend that
takes embedding input (``evaluate_embeddings``) and exposes its token-embedding matrix.

The KV cache holds the prompt and then one *superposed* state per step (recorded as
token ``-1``); it is rolled back to the prompt when decoding ends, so the prompt's KV
is reused by the next request (an autocomplete keystroke usually extends the prompt).
The math of each step lives in :mod:`tandem.kernels.superpose`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tandem.errors import UnsupportedModel
from tandem.kernels.superpose import (
    SuperposeConfig,
    combine_scores,
    expand_and_prune,
    lm_proposal,
    mixing_weights,
    superposed_embedding,
)
from tandem.models.ngram import NgramModel
from tandem.runtime.backends.protocol import Backend, EmbeddingInput, RowSource, prefill
from tandem.runtime.generate import check_prompt
from tandem.runtime.streaming_text import Detokenizer


@dataclass
class Draft:
    tokens: list[int]
    """Generated tokens, without a final end-of-generation token."""
    score: float
    """Cumulative combined (LM + n-gram) log-score; higher is better."""
    finished: bool = False
    """The draft ended with an end-of-generation token."""
    text: str = ""


@dataclass
class SuperposedResult:
    drafts: list[Draft]
    steps: int
    forward_passes: int
    """Model calls, the prompt prefill included: 1 + (steps - 1) whatever k."""
    elapsed_s: float
    stopped: str = "length"
    """``length``, ``finished`` (all best drafts ended), ``deadline`` or ``cancelled``."""
    mix_sizes: list[int] = field(default_factory=list)
    """Non-zeros of the mixing vector at each superposed step (≤ k)."""


class SuperposedDecoder:
    """k autocomplete drafts for about the cost of one greedy pass."""

    def __init__(self, target: Backend, ngram: NgramModel | None = None,
                 config: SuperposeConfig | None = None) -> None:
        if not isinstance(target, EmbeddingInput):
            raise UnsupportedModel(f"{target.name}: this backend cannot take embedding input, so it cannot superpose drafts.")
        self.target = target
        self._embedder: EmbeddingInput = target
        """The target again, as the embedding-input capability checked above."""
        self.ngram = ngram
        self.config = config or SuperposeConfig()
        self._matrix: np.ndarray | None = None
        self.forward_passes = 0
        """Every model call this decoder made (tests count them)."""

    def embedding_rows(self, tokens: np.ndarray) -> np.ndarray:
        """``E[tokens]``: from a backend that reads rows on demand (GGUF through llama.cpp:
        no table to load, so no cold start), else from its whole matrix, fetched on first use."""
        if isinstance(self.target, RowSource):
            return self.target.token_embedding_rows(tokens)
        if self._matrix is None:
            self._matrix = self._embedder.token_embeddings()
        return self._matrix[np.asarray(tokens, dtype=np.int64)]

    def _forward(self, embedding: np.ndarray) -> np.ndarray:
        self.forward_passes += 1
        return self._embedder.evaluate_embeddings(embedding[None, :])[-1]

    def _step_scores(self, histories: Sequence[Sequence[int]], cand: np.ndarray, lm_logp: np.ndarray) -> np.ndarray:
        cfg = self.config
        if self.ngram is None or cfg.alpha == 0.0:
            return combine_scores(lm_logp, np.zeros((len(histories), len(cand))), 0.0, cfg.penalty)
        ctx_len = len(cfg.ngram_weights)
        ng = np.stack([self.ngram.probs(h[-ctx_len:], cand, cfg.ngram_weights) for h in histories])
        return combine_scores(lm_logp, ng, cfg.alpha, cfg.penalty)

    def decode(
        self,
        prompt: Sequence[int],
        k: int = 3,
        max_tokens: int = 16,
        *,
        deadline: float | None = None,
        cancel: threading.Event | None = None,
        stop_at_eog: bool = True,
    ) -> SuperposedResult:
        """Decode ``k`` distinct drafts continuing ``prompt``.

        ``deadline`` is a ``time.perf_counter()`` value: decoding stops at the first step
        boundary after it and returns the drafts so far (an autocomplete latency budget).
        """
        if k < 1:
            raise ValueError("k must be at least 1")
        target, cfg = self.target, self.config
        prompt = list(prompt)
        check_prompt(target, prompt)
        max_tokens = max(0, min(max_tokens, target.n_ctx - len(prompt)))
        eog = target.special.eog if stop_at_eog else frozenset()
        start = time.perf_counter()
        passes0 = self.forward_passes
        alive: list[tuple[list[int], float]] = [([], 0.0)]
        finished: list[tuple[list[int], float]] = []
        mix_sizes: list[int] = []
        steps, stopped = 0, "length"
        try:
            if max_tokens == 0:
                return SuperposedResult([], 0, 0, 0.0)
            self.forward_passes += 1
            logits = prefill(target, prompt)
            while True:
                steps += 1
                cand, lm_logp = lm_proposal(logits, cfg.temperature, max(cfg.top_m, k))
                scores = self._step_scores([prompt + d for d, _ in alive], cand, lm_logp)
                exp = expand_and_prune(np.array([s for _, s in alive]), scores, cand, 2 * k, eog)
                new_alive: list[tuple[list[int], float]] = []
                for parent, tok, score, done in zip(exp.parents, exp.tokens, exp.scores, exp.finished, strict=True):
                    seq = [*alive[int(parent)][0], int(tok)]
                    if done:
                        finished.append((seq, float(score)))
                    elif len(new_alive) < k:
                        new_alive.append((seq, float(score)))
                finished = sorted(finished, key=lambda d: -d[1])[:k]
                alive = new_alive
                if not alive:
                    stopped = "finished"
                    break
                if len(finished) >= k and alive[0][1] <= finished[-1][1]:
                    stopped = "finished"  # scores only fall: no alive draft can still win
                    break
                if steps >= max_tokens:
                    break
                if cancel is not None and cancel.is_set():
                    stopped = "cancelled"
                    break
                if deadline is not None and time.perf_counter() >= deadline:
                    stopped = "deadline"
                    break
                if len(target.tokens) + 1 > target.n_ctx:
                    break
                mix_tokens, mix_w = mixing_weights(np.array([s for _, s in alive]), [d[-1] for d, _ in alive])
                mix_sizes.append(len(mix_tokens))
                rows = self.embedding_rows(mix_tokens)
                logits = self._forward(superposed_embedding(np.arange(len(mix_tokens)), mix_w, rows))
        finally:
            target.truncate(len(prompt))
        ranked = sorted(
            [(d, s, True) for d, s in finished] + [(d, s, False) for d, s in alive], key=lambda x: -x[1]
        )[:k]
        drafts = []
        for seq, score, done in ranked:
            toks = seq[:-1] if done else seq
            detok = Detokenizer(target.token_bytes)
            text = detok.add(toks) + detok.flush()
            drafts.append(Draft(toks, score, done, text))
        return SuperposedResult(drafts, steps, self.forward_passes - passes0,
                                time.perf_counter() - start, stopped, mix_sizes)
