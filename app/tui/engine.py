"""The models behind a chat: which target and drafter (a :class:`ModelChoice`), loading
them into a chat engine with progress, and restoring the ones a chat last used.

Free of widgets like :mod:`.session`; the chat screen runs :func:`load_engine` in a
worker thread and shows its :class:`LoadProgress` in the status line. Opening is the
one engine builder every front end uses (:func:`tandem.runtime.engine.open_engine`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tandem.runtime.chat import ChatEngine
from tandem.runtime.engine import EngineSpec, open_engine


@dataclass
class ModelChoice:
    """A target model and an optional drafter, as paths (names come from the file stems)."""

    target: Path
    drafter: Path | None = None
    n_ctx: int | None = None
    """``None``: the model's context, at most 4096, shrunk by the planner to fit."""
    n_threads: int | None = None
    """llama.cpp threads; ``None`` is every core. One thread is best for tiny models and
    on a machine busy with other work (ggml's thread barriers spin)."""
    draft_mode: str | None = None
    """``runtime.speculative`` mode; ``None`` means ``auto`` (model-free drafting always,
    the drafter when there is one), as in every front end."""
    draft_max: int = 8
    draft_len: int | None = None
    measure_cost: bool = True
    """Measure the target's verify-cost curve (cached) for the adaptive draft length."""
    budget: str | None = None
    """Host memory the chat may use (``6GiB``); ``None``: the planner's default share of RAM."""
    notes: list[str] = field(default_factory=list)
    """What the memory planner changed (e.g. a drafter it dropped), for the UI to show."""
    placement: str = "auto"
    """Where drafter and target run: ``auto`` (measured once per pair and machine, cached),
    ``gpu``/``cpu`` (the drafter there) or ``target-gpu`` (see runtime.placement)."""
    fast_verify: bool = False
    """llama.cpp's fastest kernels and long verify calls instead of the exact
    configuration (``LlamaConfig.exact``): greedy replies may differ at near-ties."""
    base: EngineSpec | None = None
    """The command line's other engine settings (``--engine``, ``--kv-type``,
    ``--kv-compress``, ``--moe-offload``, ``--vram``...), kept when the model changes."""

    def spec(self) -> EngineSpec:
        """The :class:`EngineSpec` that opens this choice."""
        base = self.base or EngineSpec(self.target)
        return replace(base, target=self.target, drafter=self.drafter, draft_mode=self.mode,
                       draft_max=self.draft_max, draft_len=self.draft_len, budget=self.budget,
                       placement=self.placement, threads=self.n_threads, n_ctx=self.n_ctx,
                       fast_verify=self.fast_verify, measure_cost=self.measure_cost)

    @property
    def target_name(self) -> str:
        return self.target.stem

    @property
    def drafter_name(self) -> str | None:
        if self.drafter is not None:
            return self.drafter.stem
        return "model-free" if self.mode not in ("off", "model", "xvocab") else None

    @property
    def mode(self) -> str:
        return self.draft_mode or "auto"


def engine_record(choice: ModelChoice) -> dict[str, Any]:
    """What a chat stores to get its models back: file paths, not names (a model given
    with ``-m FILE`` has no name in the store)."""
    return {"target": str(choice.target), "drafter": str(choice.drafter) if choice.drafter else None,
            "draft_mode": choice.draft_mode}


def restored_choice(current: ModelChoice, record: dict[str, Any]) -> ModelChoice | None:
    """``current`` with a chat's stored models, or ``None`` when a stored file has gone."""
    target = Path(record.get("target") or "")
    drafter = Path(record["drafter"]) if record.get("drafter") else None
    if not record.get("target") or not target.exists() or (drafter is not None and not drafter.exists()):
        return None
    return replace(current, target=target, drafter=drafter, draft_mode=record.get("draft_mode"), notes=[])


@dataclass
class LoadProgress:
    """What a model load is doing, for the status line: loads, placement measurements and
    the first-use verify-cost measurement can take from one second to a minute."""

    name: str
    stage: str = "starting"
    started: float = field(default_factory=time.monotonic)
    loaded: float | None = None
    """Fraction of the weights llama.cpp has loaded (set from the loading thread; the
    once-a-second tick shows it)."""

    def line(self, now: float | None = None) -> str:
        elapsed = (time.monotonic() if now is None else now) - self.started
        share = f" {self.loaded:.0%}" if self.loaded is not None and self.stage == "loading the model" else ""
        return f"Loading {self.name}: {self.stage}{share}… {elapsed:.0f} s"


def load_engine(choice: ModelChoice, progress: Callable[[str], None] | None = None,
                on_load: Callable[[float], None] | None = None) -> ChatEngine:
    """Open the target (and the drafter) as a ChatEngine (:func:`open_engine`).

    One speculative strategy is built per engine and reused for every reply, so the
    drafter, its caches and the adaptive policy persist across turns. What the builder
    changed or chose (a drafter the planner dropped, a KV type, a placement) goes to
    ``choice.notes`` for the UI to show.
    """
    engine = open_engine(choice.spec(), notify=progress, on_load=on_load)
    choice.notes.extend(engine.notes)
    return ChatEngine(engine.target, engine.strategy, drafter=engine.drafter_backend, owner=engine)


def close_engine(engine: Any) -> None:
    """Free the engine's strategy and models (``None`` is fine: nothing was loaded)."""
    if engine is not None:
        engine.close()
