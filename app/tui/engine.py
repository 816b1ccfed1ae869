"""The models behind a chat: which target and drafter (a :class:`ModelChoice`), loading
them into a chat engine with progress, and restoring the ones a chat last used.

Free of widgets like :mod:`.session`; the chat screen runs :func:`load_engine` in a
worker thread and shows its :class:`LoadProgress` in the status line.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tandem.models.errors import TandemError


@dataclass
class ModelChoice:
    """A target model and an optional drafter, as paths (names come from the file stems)."""

    target: Path
    drafter: Path | None = None
    n_ctx: int | None = 2048
    n_threads: int | None = None
    """llama.cpp threads; ``None`` is every core. One thread is best for tiny models and
    on a machine busy with other work (ggml's thread barriers spin)."""
    draft_mode: str | None = None
    """``runtime.speculative`` mode; ``None`` means ``auto`` with a drafter, else ``off``."""
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
        return self.draft_mode or ("auto" if self.drafter is not None else "off")


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


def speculative_available() -> bool:
    try:
        from tandem.runtime.speculative import loop as speculative
    except ImportError:
        return False
    return hasattr(speculative, "build_strategy")


@dataclass
class LoadProgress:
    """What a model load is doing, for the status line: loads, placement measurements and
    the first-use verify-cost measurement can take from one second to a minute."""

    name: str
    stage: str = "starting"
    started: float = field(default_factory=time.monotonic)

    def line(self, now: float | None = None) -> str:
        elapsed = (time.monotonic() if now is None else now) - self.started
        return f"Loading {self.name}: {self.stage}… {elapsed:.0f} s"


def load_engine(choice: ModelChoice, progress: Callable[[str], None] | None = None) -> Any:
    """Open the target (and the drafter) as a ChatEngine, speculative when asked for.

    One speculative strategy is built per engine and reused for every reply, so the
    drafter, its caches and the adaptive policy persist across turns. The drafter
    backend is opened here (same threads and context as the target) and handed to the
    strategy, so the engine can report its memory.
    """
    from tandem.runtime.backends.opener import backend_kind, open_backend
    from tandem.runtime.chat import ChatEngine
    from tandem.runtime.planning.planner import plan_for_run

    def say(stage: str) -> None:
        if progress is not None:
            progress(stage)

    wants_drafter = choice.drafter is not None and choice.mode != "off"
    if backend_kind(choice.target) != "gguf" or (wants_drafter and backend_kind(choice.drafter) != "gguf"):
        # ONNX exports and Hugging Face folders: the planner prices llama.cpp models only,
        # so such a target gets a budget check before it loads (BudgetError if it cannot fit).
        if backend_kind(choice.target) != "gguf":
            from tandem.runtime.planning.other_targets import plan_unplanned

            plan_unplanned(choice.target, backend_kind(choice.target), choice.budget, choice.n_ctx)
        say("loading the model")
        target = open_backend(choice.target, n_ctx=choice.n_ctx, n_threads=choice.n_threads)
        plan, drafter_path = None, choice.drafter if wants_drafter else None
    else:
        # The memory planner sizes both models to the budget (BudgetError if nothing fits).
        say("planning memory")
        plan = plan_for_run(choice.target, choice.drafter if wants_drafter else None, choice.budget,
                            choice.n_ctx, threads=choice.n_threads, draft_max=choice.draft_max,
                            drop_slow_draft=False)
        drafter_path = choice.drafter if plan.draft is not None else None
        if wants_drafter and drafter_path is None:
            choice.notes.append("memory planner: " + "; ".join(plan.reasons))
        say("loading the model")
        target = open_backend(choice.target,
                              llama_config=replace(plan.target.llama_config(), exact=not choice.fast_verify))
    if choice.mode == "off" or (drafter_path is None and choice.mode in ("model", "xvocab")):
        return ChatEngine(target)
    drafter = None
    try:
        if not speculative_available():
            raise TandemError("Speculative decoding is not available in this build: run without a drafter.")
        from tandem.runtime.planning.calibration import place
        from tandem.runtime.planning.placement import Placed
        from tandem.runtime.speculative.factory import SpecOptions, build_strategy

        planned = plan.draft if plan is not None else None
        placed = Placed()
        if planned is not None and drafter_path is not None and choice.mode in ("auto", "model", "xvocab"):
            say("placing the drafter (measured on a pair's first run)")
            placed = place(target, plan, mode=choice.mode, device=choice.placement, notify=choice.notes.append)
            target = placed.target  # reopened on the GPU when the target is placed there
            drafter_path = Path(placed.draft_path)  # the file the planner priced (maybe a quantized copy)
            if placed.choice is not None:
                choice.notes.append(f"placement: {placed.choice.option.name} (measured)")
        config = placed.llama_config
        say("loading the drafter")
        drafter = (open_backend(drafter_path, n_ctx=choice.n_ctx, n_threads=choice.n_threads, llama_config=config)
                   if drafter_path is not None and placed.draft_device != "cuda" else None)
        options = SpecOptions(mode=choice.mode, draft_max=plan.draft_max if plan else choice.draft_max,
                              draft_length=choice.draft_len, measure_cost=choice.measure_cost,
                              draft_window=planned.window if planned is not None else None,
                              draft_device=placed.draft_device, predraft=placed.predraft,
                              draft_cost=placed.draft_cost)
        say("preparing speculative decoding (the first run measures the model's speed)")
        strategy = build_strategy(target, drafter if drafter is not None else drafter_path, options,
                                  llama_config=config, torch_config=placed.torch_config)
    except BaseException:
        if drafter is not None:
            drafter.close()
        target.close()
        raise
    return ChatEngine(target, strategy, drafter=drafter)


def close_engine(engine: Any) -> None:
    """Free the engine's strategy and models (``None`` is fine: nothing was loaded)."""
    if engine is not None:
        engine.close()
