"""A drafter model that is opened the first time it is asked to compute.

Loading the Qwen2.5-Coder-0.5B drafter takes 0.57-0.75 s (2 threads, an AVX2 EPYC),
mostly llama.cpp building its 151k-token vocabulary. Where the adaptive policy has
learnt that drafting with it does not pay (that machine at 2 threads), a whole
`tandem run` asks it for nothing, and that load was a pure loss. A
:class:`DeferredBackend` stands in for the model until something needs it: it answers
what it knows without the model (its name, context, an empty cache), and opens the model
on the first call that computes or reads the vocabulary. The memory planner priced the
drafter all the same, so opening it later never overshoots the budget.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from tandem.errors import TandemError
from tandem.runtime.backends.protocol import Backend, ComputeSettings, MemoryReport, SpecialTokens


class DrafterUnavailable(TandemError):
    """The deferred model could not be opened (or is not the model it stood in for):
    the drafter drafts nothing from then on, and decoding goes on without it."""


class DeferredBackend:
    """A :class:`~tandem.runtime.backends.protocol.Backend` opened on first need.

    ``opener`` opens the real backend; ``check`` (optional) inspects it once opened and
    raises :class:`DrafterUnavailable` when it cannot serve (a drafter whose vocabulary
    no longer matches its target's). ``weights`` is the bytes of weights it will map: a
    drafter's cost is guessed from that share before it is timed.
    """

    def __init__(self, path: Path, *, n_ctx: int, weights: int, opener: Callable[[], Backend],
                 check: Callable[[Backend], None] | None = None) -> None:
        self.path = path
        self.name = path.stem
        self.weights = weights
        self._n_ctx = n_ctx
        self._opener = opener
        self.check = check
        self._backend: Backend | None = None
        self._failed: DrafterUnavailable | None = None
        self._threads: int | None = None
        self._closed = False
        self._lock = threading.Lock()

    # -- what it knows without the model ------------------------------------------------
    @property
    def is_open(self) -> bool:
        return self._backend is not None

    @property
    def n_ctx(self) -> int:
        return self._backend.n_ctx if self._backend is not None else self._n_ctx

    @property
    def tokens(self) -> list[int]:
        return self._backend.tokens if self._backend is not None else []

    def truncate(self, n: int) -> None:
        if self._backend is not None:
            self._backend.truncate(n)  # an unopened model holds nothing to roll back

    def memory(self) -> MemoryReport:
        """What it holds: nothing until it is opened."""
        return self._backend.memory() if self._backend is not None else MemoryReport(weights=0, kv_cache=0)

    def set_threads(self, n: int) -> bool:
        if self._backend is not None:
            return self._backend.set_threads(n)
        if n < 1:
            return False
        self._threads = n  # applied when it opens
        return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._backend is not None:
                backend, self._backend = self._backend, None
                backend.close()

    # -- what needs the model -----------------------------------------------------------
    def opened(self) -> Backend:
        """The real backend, opened now if it was not (once; thread-safe)."""
        if self._backend is not None:
            return self._backend
        with self._lock:
            if self._backend is None:
                if self._failed is not None:
                    raise self._failed
                if self._closed:
                    raise DrafterUnavailable(f"The drafter {self.name} was closed.")
                self._backend = self._opened_now()
        return self._backend

    def _opened_now(self) -> Backend:
        try:
            backend = self._opener()
        except TandemError as exc:
            self._failed = DrafterUnavailable(f"The drafter {self.name} could not be loaded: {exc}")
            raise self._failed from exc
        try:
            if self.check is not None:
                self.check(backend)
            if self._threads is not None:
                backend.set_threads(self._threads)
        except BaseException as exc:
            backend.close()
            if isinstance(exc, DrafterUnavailable):
                self._failed = exc
            raise
        return backend

    @property
    def n_vocab(self) -> int:
        return self.opened().n_vocab

    @property
    def special(self) -> SpecialTokens:
        return self.opened().special

    @property
    def exact_batch(self) -> int | None:
        return self.opened().exact_batch

    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]:
        return self.opened().tokenize(text, add_bos=add_bos, special=special)

    def token_bytes(self, token: int) -> bytes:
        return self.opened().token_bytes(token)

    def chat_template(self) -> str | None:
        return self.opened().chat_template()

    def evaluate(self, tokens: Sequence[int], logits_for: Sequence[int] | None = None) -> np.ndarray:
        return self.opened().evaluate(tokens, logits_for)

    @property
    def failure(self) -> str | None:
        """Why it could not be opened, once that was tried and failed."""
        return str(self._failed) if self._failed is not None else None

    def keep_spans(self, spans: Sequence[tuple[int, int]]) -> bool:
        return self._backend.keep_spans(spans) if self._backend is not None else False

    def compute_settings(self) -> ComputeSettings:
        return self.opened().compute_settings()


def weight_bytes(backend: Backend) -> int:
    """Bytes of weights ``backend`` maps, or will map once a deferred one opens."""
    return backend.weights if isinstance(backend, DeferredBackend) else backend.memory().weights
