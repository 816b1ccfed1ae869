"""The models a server holds: each with its backend, chat engine, autocompleter and worker."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tandem.app.server.worker import ModelWorker
from tandem.models.errors import TandemError
from tandem.models.ngram import NgramModel
from tandem.runtime.autocomplete.drafts import AutocompleteConfig, Autocompleter, load_ngram_for
from tandem.runtime.backends.protocol import Backend
from tandem.runtime.chat import ChatEngine


def speculative_factory(target: Backend, draft: str | None, llama_config=None) -> tuple[Any, str]:
    """One speculative strategy for the model's lifetime (``runtime.speculative.build_strategy``).

    The strategy is built once, at load time: it owns the drafter and the adaptive
    policy (whose verify-cost curve is measured on first use), so every request reuses
    them. Returns (strategy or None, a short description for ``/v1/models``).
    Speculative decoding is lossless: without it output is the same, only slower.
    """
    try:
        from tandem.runtime.speculative.factory import SpecOptions, build_strategy
    except ImportError:
        return None, "off (speculative runtime not installed)"
    # no suffix tree shared across requests: it would let one client probe another's text
    strategy = build_strategy(target, draft, SpecOptions(shared_suffix_cache=False), llama_config=llama_config)
    desc = strategy.describe() if hasattr(strategy, "describe") else {}
    return strategy, f"on ({desc.get('drafter') or 'plain'})"


@dataclass
class ModelSlot:
    name: str
    target: Backend
    engine: ChatEngine
    worker: ModelWorker
    ngram: NgramModel | None = None
    speculative: str = "off"
    strategy: Any = None
    created: int = field(default_factory=lambda: int(time.time()))
    _auto: Autocompleter | None = None
    infill_owner: tuple[str, tuple[int, ...]] | None = None
    """Which client's /infill left the KV cache, and what it left (see app.server.infill)."""

    @property
    def autocompleter(self) -> Autocompleter:
        """Built on first use: it reads the token-embedding matrix from the model file."""
        if self._auto is None:
            self._auto = Autocompleter(self.target, self.ngram, AutocompleteConfig(), lock=self.engine.lock)
        return self._auto

    def close(self) -> None:
        self.worker.close()
        self.engine.close()


def make_slot(target: Backend, *, name: str | None = None, draft: str | None = None, speculative: bool = True,
              ngram: NgramModel | None = None, max_queue: int = 64, llama_config=None) -> ModelSlot:
    strategy, desc = speculative_factory(target, draft, llama_config) if speculative else (None, "off")
    engine = ChatEngine(target, strategy)
    slot_name = name or target.name
    return ModelSlot(slot_name, target, engine, ModelWorker(slot_name, max_queue), ngram, desc, strategy)


def load_model(model: str, *, draft: str | None = None, speculative: bool = True, n_ctx: int | None = None,
               n_threads: int | None = None, ngram_name: str | None = None, max_queue: int = 64) -> ModelSlot:
    """Open ``model`` (and its drafter ``draft``) from a path or the store, ready to serve."""
    from tandem.models.store import resolve_model
    from tandem.runtime.backends.llama import LlamaConfig
    from tandem.runtime.backends.opener import open_backend

    if draft and not speculative:
        raise TandemError("--draft needs speculative decoding on (drop --no-spec).")
    target = open_backend(resolve_model(model), n_ctx=n_ctx, n_threads=n_threads)
    try:
        ngram = load_ngram_for(target, ngram_name)
        if ngram_name and ngram is None:
            raise TandemError(f"No n-gram model named {ngram_name!r} for this model's tokenizer; "
                              "build one with `tandem ngram build PATH... -m MODEL --name NAME`.")
        return make_slot(target, draft=draft, speculative=speculative, ngram=ngram, max_queue=max_queue,
                         llama_config=LlamaConfig(n_ctx=target.n_ctx, n_threads=n_threads))
    except BaseException:
        target.close()
        raise
