"""The models a server holds: each with its engine, chat engine, autocompleter and worker.

A model is opened by the one engine builder every front end uses
(:func:`tandem.runtime.engine.open_engine`), with the same flags and defaults as
`tandem run`; the server only adds per-client isolation (no suffix tree shared across
requests: what drafts well would reveal other clients' text).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from tandem.app.server.worker import ModelWorker
from tandem.models.errors import TandemError
from tandem.models.ngram import NgramModel
from tandem.runtime.autocomplete.drafts import AutocompleteConfig, Autocompleter, load_ngram_for
from tandem.runtime.backends.protocol import Backend
from tandem.runtime.chat import ChatEngine
from tandem.runtime.engine import Engine, EngineSpec, engine_for, open_engine
from tandem.runtime.speculative.factory import SpeculativeStrategy


def isolated(spec: EngineSpec) -> EngineSpec:
    """``spec`` as the server runs it: model-free drafting learns from each request alone."""
    return replace(spec, suffix_memory="request")


def speculation_label(strategy: SpeculativeStrategy) -> str:
    """A short description for ``/v1/models``: ``on (drafter)`` or ``off``."""
    drafter = strategy.describe().get("drafter")
    return f"on ({drafter})" if drafter else "off"


@dataclass
class ModelSlot:
    name: str
    target: Backend
    engine: ChatEngine
    worker: ModelWorker
    ngram: NgramModel | None = None
    speculative: str = "off"
    strategy: SpeculativeStrategy | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    _auto: Autocompleter | None = None
    kv_owner: tuple[str, tuple[int, ...]] | None = None
    """Which client's request left the KV cache, and what it left (see :mod:`.cache_owner`)."""
    notes: list[str] = field(default_factory=list)
    """What the engine builder chose or changed (a KV type for the budget, a placement...)."""

    @property
    def autocompleter(self) -> Autocompleter:
        """Built on first use: it reads the token-embedding matrix from the model file."""
        if self._auto is None:
            self._auto = Autocompleter(self.target, self.ngram, AutocompleteConfig(), lock=self.engine.lock)
        return self._auto

    def close(self) -> None:
        self.worker.close()
        self.engine.close()


def slot_for(engine: Engine, *, name: str | None = None, ngram: NgramModel | None = None,
             max_queue: int = 64) -> ModelSlot:
    """A slot serving ``engine`` (which the slot owns from here on)."""
    chat = ChatEngine(engine.target, engine.strategy, drafter=engine.drafter_backend, owner=engine)
    slot_name = name or engine.target.name
    return ModelSlot(slot_name, engine.target, chat, ModelWorker(slot_name, max_queue), ngram,
                     speculation_label(engine.strategy), engine.strategy, notes=list(engine.notes))


def make_slot(target: Backend, *, name: str | None = None, speculative: bool = True,
              ngram: NgramModel | None = None, max_queue: int = 64) -> ModelSlot:
    """A slot around a target opened elsewhere (tests, benchmarks): model-free drafting
    (``auto``, isolated per request), or plain decoding without ``speculative``."""
    from pathlib import Path

    spec = isolated(EngineSpec(Path(target.name), draft_mode="auto" if speculative else "off"))
    return slot_for(engine_for(target, spec), name=name, ngram=ngram, max_queue=max_queue)


def load_model(spec: EngineSpec, *, ngram_name: str | None = None, max_queue: int = 64,
               notify: Callable[[str], None] | None = None,
               on_load: Callable[[float], None] | None = None) -> ModelSlot:
    """Open ``spec``'s model (and drafter) with :func:`open_engine`, isolated per client,
    ready to serve."""
    engine = open_engine(isolated(spec), notify=notify, on_load=on_load)
    try:
        ngram = load_ngram_for(engine.target, ngram_name)
        if ngram_name and ngram is None:
            raise TandemError(f"No n-gram model named {ngram_name!r} for this model's tokenizer; "
                              "build one with `tandem ngram build PATH... -m MODEL --name NAME`.")
        return slot_for(engine, ngram=ngram, max_queue=max_queue)
    except BaseException:
        engine.close()
        raise
