"""The models behind a chat: which target and drafter (a :class:`ModelChoice`), loading
them into a chat engine with progress, and restoring the ones a chat last used.

Free of widgets like :mod:`.session`; :class:`.model_loading.ModelLoader` runs
:func:`load_engine` in a worker thread and shows its :class:`LoadProgress` in the status
line. Opening is the one engine builder every front end uses
(:func:`tandem.runtime.engine.builder.open_engine`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.runtime.engine.spec import EngineSpec

if TYPE_CHECKING:
    from tandem.runtime.chat import ChatEngine


@dataclass
class ModelChoice:
    """The engine a chat opens (its :class:`EngineSpec`: target, drafter, draft mode and
    the command line's other engine settings, kept when the model changes), and what the
    builder said about it. Names come from the file stems."""

    spec: EngineSpec
    notes: list[str] = field(default_factory=list)
    """What the memory planner changed (e.g. a drafter it dropped), for the UI to show."""

    @property
    def target(self) -> Path:
        return self.spec.target

    @property
    def drafter(self) -> Path | None:
        return self.spec.drafter

    @property
    def mode(self) -> str:
        return self.spec.draft_mode

    @property
    def target_name(self) -> str:
        return self.target.stem

    @property
    def drafter_name(self) -> str | None:
        if self.drafter is not None:
            return self.drafter.stem
        return "model-free" if self.mode not in ("off", "model", "xvocab") else None

    def with_models(self, target: Path, drafter: Path | None, draft_mode: str = "auto") -> ModelChoice:
        """The same settings with other models (and no notes yet)."""
        return ModelChoice(replace(self.spec, target=target, drafter=drafter, draft_mode=draft_mode))


def engine_record(choice: ModelChoice) -> dict[str, Any]:
    """What a chat stores to get its models back: file paths, not names (a model given
    with ``-m FILE`` has no name in the store)."""
    return {"target": str(choice.target), "drafter": str(choice.drafter) if choice.drafter else None,
            "draft_mode": choice.mode}


def restored_choice(current: ModelChoice, record: dict[str, Any]) -> ModelChoice | None:
    """``current`` with a chat's stored models, or ``None`` when a stored file has gone."""
    target = Path(record.get("target") or "")
    drafter = Path(record["drafter"]) if record.get("drafter") else None
    if not record.get("target") or not target.exists() or (drafter is not None and not drafter.exists()):
        return None
    return current.with_models(target, drafter, record.get("draft_mode") or "auto")


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
    ``choice.notes`` for the UI to show. Runs in the load's worker thread, which is
    also where the runtime (numpy, llama.cpp) is first imported.
    """
    # local: keeps the runtime out of the chat app's first paint
    from tandem.runtime.chat import ChatEngine
    from tandem.runtime.engine.builder import open_engine

    engine = open_engine(choice.spec, notify=progress, on_load=on_load)
    choice.notes.extend(engine.notes)
    return ChatEngine(engine.target, engine.strategy, drafter=engine.drafter_backend, owner=engine)


def close_engine(engine: Any) -> None:
    """Free the engine's strategy and models (``None`` is fine: nothing was loaded)."""
    if engine is not None:
        engine.close()
