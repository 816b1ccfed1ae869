"""A same-vocabulary model drafter over any :class:`Backend`.

The drafter keeps its own KV cache a prefix of the committed sequence: each proposal
first catches up on what was committed since the last round (one batched call), then
drafts token by token. Its proposal distribution q is built by the very same
:class:`Sampler` transformations as the target's p (temperature, top-k/p, min-p,
repetition penalty), so q is one-hot in greedy mode and the acceptance rate is as high
as the two models allow.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from tandem.kernels.sampling import Sampler
from tandem.runtime.backends.deferred import DrafterUnavailable, weight_bytes
from tandem.runtime.backends.protocol import Backend, common_prefix_len, unseen
from tandem.runtime.speculative.drafters.base import Draft


def token_probability(logits: np.ndarray, token: int) -> float:
    """softmax(logits)[token] without building the whole distribution twice."""
    x = np.asarray(logits, dtype=np.float64)
    return float(1.0 / np.sum(np.exp(x - x[token])))


VOCAB_SAMPLE = 4096
"""Token ids :func:`same_vocabulary` compares, spread over the vocabulary."""


def same_vocabulary(a: Backend, b: Backend) -> bool:
    """True when token ids mean the same bytes in both models (same-vocabulary drafting).

    A drafter may have fewer ids than the target (padding rows in the target's
    embedding table). The first and last 512 ids (bytes, control tokens) and a spread
    of :data:`VOCAB_SAMPLE` others are compared, not all of them: 151,936 Qwen pieces
    took a second per strategy built. A tokenizer that differed only elsewhere would
    cost acceptance, never correctness: the target verifies every drafted token."""
    n = min(a.n_vocab, b.n_vocab)
    if max(a.n_vocab, b.n_vocab) > n + 128:  # padding, not a different tokenizer
        return False
    ids = set(range(min(n, 512))) | set(range(max(0, n - 512), n)) | set(range(0, n, max(1, n // VOCAB_SAMPLE)))
    return all(a.token_bytes(t) == b.token_bytes(t) for t in sorted(ids))


class ModelDrafter:
    """Draft with a small model sharing the target's vocabulary.

    ``stop_threshold`` (SpecDec++): stop drafting as soon as the estimated chance that
    at least one drafted token is rejected, ``1 - prod(a_i)``, exceeds it, where a_i is
    the drafter's own probability of token i scaled by a running calibration against
    the acceptances observed in :meth:`commit`.
    """

    def __init__(
        self, backend: Backend, *, stop_threshold: float | None = None, owns_backend: bool = True
    ) -> None:
        self.backend = backend
        self.name = f"model:{backend.name}"
        self.stop_threshold = stop_threshold
        self.owns_backend = owns_backend
        self.calls = 0
        """Forward calls made so far (catch-up and drafting), for DecodeStats.draft_calls."""
        self._calib_acc = 0.0
        self._calib_conf = 0.0
        self._last_conf: list[float] | None = None
        self.unavailable: str | None = None
        """Why its model could not be opened (a deferred drafter: :mod:`tandem.runtime.backends.deferred`);
        it drafts nothing from then on."""

    def backlog(self, context: Sequence[int]) -> int:
        return 0 if self.unavailable else unseen(self.backend, context)

    def _catch_up(self, context: Sequence[int], backlog: int) -> np.ndarray:
        """Bring the cache to ``context`` (``backlog`` tokens and the last one past what it
        keeps) and return the logits after its last token."""
        reuse = len(context) - 1 - backlog
        self.backend.truncate(reuse)
        self.calls += 1
        return self.backend.evaluate(list(context[reuse:]))[-1]

    def propose(self, context: Sequence[int], max_tokens: int, sampler: Sampler) -> Draft:
        k = min(max_tokens, self.backend.n_ctx - len(context))
        if k <= 0 or not context or self.unavailable:
            return Draft([], None, self.name)
        backlog = self.backlog(context)
        started = time.perf_counter()
        try:
            logits = self._catch_up(context, backlog)
        except DrafterUnavailable as exc:  # a deferred model that failed to open: decode on without it
            self.unavailable = str(exc)
            return Draft([], None, self.name)
        catch_up_s = time.perf_counter() - started
        penalize = sampler.params.penalized
        history = list(context) if penalize else []
        tokens: list[int] = []
        rows: list[np.ndarray] = []
        confidence: list[float] = []
        all_accepted = 1.0
        for i in range(k):
            if sampler.greedy:
                x = sampler(logits, history)
                conf = token_probability(sampler.adjusted(logits, history), x)
            else:
                q = sampler.distribution(logits, history)
                x = sampler.draw(q)
                rows.append(q)
                conf = float(q[x])
            tokens.append(x)
            confidence.append(conf)
            if penalize:
                history.append(x)
            all_accepted *= min(1.0, conf * self.calibration())
            if i == k - 1:
                break
            if self.stop_threshold is not None and 1.0 - all_accepted > self.stop_threshold:
                break
            self.calls += 1
            logits = self.backend.evaluate([x])[-1]
        q_out = None if sampler.greedy else np.stack(rows)
        self._last_conf = confidence
        return Draft(tokens, q_out, self.name, confidence).caught_up(catch_up_s, backlog)

    def calibration(self) -> float:
        """Observed acceptances per unit of own probability (decayed). Greedy acceptance
        needs only argmax agreement, so a drafter's raw probability underestimates it."""
        return float(np.clip((self._calib_acc + 2.0) / (self._calib_conf + 2.0), 0.2, 5.0))

    def commit(self, context: Sequence[int], n_accepted: int) -> None:
        """Drop rejected drafts from the cache so it stays a prefix of ``context``;
        update the confidence calibration the SpecDec++ stop uses."""
        self.backend.truncate(common_prefix_len(self.backend.tokens, context))
        if self._last_conf:
            tested = min(len(self._last_conf), n_accepted + 1)
            self._calib_acc = 0.98 * self._calib_acc + n_accepted
            self._calib_conf = 0.98 * self._calib_conf + sum(self._last_conf[:tested])
            self._last_conf = None

    def weight_bytes(self) -> int:
        return weight_bytes(self.backend)

    def model_backend(self) -> Backend:
        return self.backend

    def prime(self, tokens: Sequence[int]) -> None:
        """Not used: see :meth:`~tandem.runtime.speculative.drafters.base.Drafter.prime`."""

    def close(self) -> None:
        if self.owns_backend:
            self.backend.close()
