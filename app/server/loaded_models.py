"""The models a server holds: each with its engine, chat engine, lanes and worker.

A model is opened by the one engine builder every front end uses
(:func:`tandem.runtime.engine.builder.open_engine`), with the same flags and defaults as
`tandem run`; the server only adds per-client isolation (no suffix tree shared across
requests: what drafts well would reveal other clients' text).

A model serves ``parallel`` requests at once, one per :class:`Lane`: one KV sequence of
the shared llama.cpp context (:mod:`tandem.runtime.backends.llama_batch`), with its own
strategy (drafters hold per-request state), its own lock and its own record of whose
text its cache holds (:mod:`.cache_owner`). With one lane the lane is the engine itself.
A drafter model serves one sequence, so with more than one lane drafting is model-free.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from tandem.app.server.worker import ModelWorker
from tandem.errors import TandemError
from tandem.models.ngram import NgramModel
from tandem.runtime.autocomplete.drafts import AutocompleteConfig, Autocompleter, load_ngram_for
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_batch import SequenceBatcher
from tandem.runtime.backends.protocol import Backend
from tandem.runtime.backends.sequence_view import SequenceView, open_views
from tandem.runtime.chat import ChatEngine
from tandem.runtime.engine.builder import Engine, engine_for, open_engine
from tandem.runtime.engine.checks import spec_options
from tandem.runtime.engine.spec import EngineSpec
from tandem.runtime.generate import Strategy
from tandem.runtime.speculative.factory import SpeculativeStrategy, build_strategy


def isolated(spec: EngineSpec) -> EngineSpec:
    """``spec`` as the server runs it: model-free drafting learns from each request alone."""
    return replace(spec, suffix_memory="request")


def speculation_label(strategy: SpeculativeStrategy) -> str:
    """A short description for ``/v1/models``: ``on (drafter)`` or ``off``."""
    drafter = strategy.describe().get("drafter")
    return f"on ({drafter})" if drafter else "off"


@dataclass
class Lane:
    """One slot of a model: a KV sequence, the strategy that generates on it, the lock
    that serialises its cache, and whose text that cache holds."""

    index: int
    target: Backend
    strategy: Strategy
    lock: threading.Lock
    kv_owner: tuple[str, tuple[int, ...]] | None = None
    """Which client's request left the KV cache, and what it left (see :mod:`.cache_owner`)."""
    ngram: NgramModel | None = None
    _auto: Autocompleter | None = None

    @property
    def autocompleter(self) -> Autocompleter:
        """Built on first use: it reads the token-embedding matrix from the model file."""
        if self._auto is None:
            self._auto = Autocompleter(self.target, self.ngram, AutocompleteConfig(), lock=self.lock)
        return self._auto

    @contextlib.contextmanager
    def engaged(self, urgent: bool = False) -> Iterator[None]:
        """Around a job: the batcher waits for this lane's next step (see
        :class:`~tandem.runtime.backends.llama_batch.SequenceBatcher`); ``urgent`` (an
        /infill) has the batch to itself until :meth:`settle`."""
        if isinstance(self.target, SequenceView):
            with self.target.engaged(urgent):
                yield
        else:
            yield

    def settle(self) -> None:
        """An urgent job's first token is out: the other lanes decode again (see
        :meth:`~tandem.runtime.backends.sequence_view.SequenceView.settle`)."""
        if isinstance(self.target, SequenceView):
            self.target.settle()

    def interrupt(self) -> None:
        """This lane's job was superseded: a step it is waiting for is withdrawn (see
        :meth:`~tandem.runtime.backends.sequence_view.SequenceView.interrupt`)."""
        if isinstance(self.target, SequenceView):
            self.target.interrupt()

    def owner_client(self) -> str | None:
        return self.kv_owner[0] if self.kv_owner is not None else None


@dataclass
class ModelSlot:
    name: str
    target: Backend
    """The model (tokenizer, context size); generation runs on a lane's ``target``."""
    engine: ChatEngine
    worker: ModelWorker[Lane]
    ngram: NgramModel | None = None
    speculative: str = "off"
    strategy: SpeculativeStrategy | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    notes: list[str] = field(default_factory=list)
    """What the engine builder chose or changed (a KV type for the budget, a placement...)."""
    batcher: SequenceBatcher | None = None
    """The shared decodes of the lanes' sequences (``None`` with one lane)."""

    @property
    def lanes(self) -> list[Lane]:
        return self.worker.lanes

    def close(self) -> None:
        self.worker.close()
        for lane in self.lanes:
            if lane.strategy is not self.engine.strategy and isinstance(lane.strategy, SpeculativeStrategy):
                lane.strategy.close()
        if self.batcher is not None:
            self.batcher.close()
        self.engine.close()


def _lanes(engine: Engine, ngram: NgramModel | None, chat: ChatEngine) -> tuple[list[Lane], SequenceBatcher | None]:
    """One lane per KV sequence of the engine's target (one: the engine itself)."""
    if not isinstance(engine.target, LlamaCppBackend) or engine.target.n_seq < 2:
        return [Lane(0, engine.target, engine.strategy, chat.lock, ngram=ngram)], None
    batcher = open_views(engine.target)
    options = spec_options(engine.spec)
    lanes = [Lane(i, view, build_strategy(view, None, options), threading.Lock(), ngram=ngram)
             for i, view in enumerate(batcher.views)]
    return lanes, batcher


def slot_for(engine: Engine, *, name: str | None = None, ngram: NgramModel | None = None,
             max_queue: int = 64) -> ModelSlot:
    """A slot serving ``engine`` (which the slot owns from here on)."""
    chat = ChatEngine(engine.target, engine.strategy, drafter=engine.drafter_backend, owner=engine)
    slot_name = name or engine.target.name
    lanes, batcher = _lanes(engine, ngram, chat)
    worker: ModelWorker[Lane] = ModelWorker(slot_name, max_queue, lanes, owner=Lane.owner_client,
                                            interrupt=Lane.interrupt, hold=batcher.hold if batcher else None)
    return ModelSlot(slot_name, engine.target, chat, worker, ngram, speculation_label(engine.strategy),
                     engine.strategy, notes=list(engine.notes), batcher=batcher)


def make_slot(target: Backend, *, name: str | None = None, speculative: bool = True,
              ngram: NgramModel | None = None, max_queue: int = 64) -> ModelSlot:
    """A slot around a target opened elsewhere (tests, benchmarks): model-free drafting
    (``auto``, isolated per request), or plain decoding without ``speculative``."""

    spec = isolated(EngineSpec(Path(target.name), draft_mode="auto" if speculative else "off"))
    return slot_for(engine_for(target, spec), name=name, ngram=ngram, max_queue=max_queue)


def parallel_spec(spec: EngineSpec) -> tuple[EngineSpec, list[str]]:
    """``spec`` for its slots: a drafter model serves one sequence, so with more than
    one slot drafting is model-free (said in the notes)."""
    if spec.parallel < 2 or spec.drafter is None:
        return spec, []
    mode = spec.draft_mode if spec.draft_mode in ("off", "ngram") else "auto"
    note = (f"parallel slots: {spec.parallel}; drafting is model-free in each slot "
            f"(the drafter {spec.drafter.name} serves one sequence; --parallel 1 keeps it)")
    return replace(spec, drafter=None, draft_mode=mode), [note]


def load_model(spec: EngineSpec, *, ngram_name: str | None = None, max_queue: int = 64,
               notify: Callable[[str], None] | None = None,
               on_load: Callable[[float], None] | None = None) -> ModelSlot:
    """Open ``spec``'s model (and drafter) with :func:`open_engine`, isolated per client,
    ready to serve with ``spec.parallel`` slots."""
    spec, notes = parallel_spec(spec)
    engine = open_engine(isolated(spec), notify=notify, on_load=on_load)
    engine.notes[:0] = notes
    try:
        ngram = load_ngram_for(engine.target, ngram_name)
        if ngram_name and ngram is None:
            raise TandemError(f"No n-gram model named {ngram_name!r} for this model's tokenizer; "
                              "build one with `tandem ngram build PATH... -m MODEL --name NAME`.")
        return slot_for(engine, ngram=ngram, max_queue=max_queue)
    except BaseException:
        engine.close()
        raise
