"""One engine builder for every front end: plan -> open -> place -> strategy.

`tandem run`, `tandem chat`, `tandem serve` and `tandem bench` describe what they want
as an :class:`EngineSpec` and call :func:`open_engine`, which

1. **plans**: a GGUF target in llama.cpp goes through the memory planner
   (:func:`tandem.runtime.planning.planner.plan_for_run`: context, KV type, batch, the
   drafter's window and quantized copy, GPU layers; ``BudgetError`` when nothing fits);
   a target in the torch engine or onnxruntime is priced and budget-checked
   (:mod:`tandem.runtime.planning.torch_target`, :mod:`tandem.runtime.planning.other_targets`);
2. **opens** the target once, as planned (and applies the torch engine's KV compression
   and MoE expert offload when asked);
3. **places** the drafter (:func:`tandem.runtime.planning.calibration.place`: measured
   once per pair and machine, cached); the drafter backend the calibration opened is
   handed over, so each model is opened exactly once;
4. builds the **strategy** (:func:`tandem.runtime.speculative.factory.build_strategy`).

The :class:`Engine` owns all of it and closes it in reverse order. Defaults are the same
for every front end (README, "Using it"): draft mode ``auto`` (model-free drafting
always on, the drafter when one is named, adaptive length, switched off when it does not
pay), placement ``auto``, llama.cpp's exact configuration, f16 KV unless the budget
needs less.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from tandem.runtime.backends.llama_kernels import KernelChoice, choose_kernels, measure_later
from tandem.runtime.backends.opener import backend_kind, open_backend
from tandem.runtime.backends.protocol import Backend
from tandem.runtime.engine.checks import check_spec, spec_options, target_engine
from tandem.runtime.engine.spec import EngineSpec
from tandem.runtime.machine import cpu_cores
from tandem.runtime.planning.calibration import place
from tandem.runtime.planning.hardware import parse_size
from tandem.runtime.planning.other_targets import plan_unplanned
from tandem.runtime.planning.placement import Choice
from tandem.runtime.planning.plan import Plan
from tandem.runtime.planning.planner import plan_for_run
from tandem.runtime.planning.torch_target import TorchPlan, plan_torch
from tandem.runtime.speculative.drafter_model import deferred_draft_backend, open_draft_backend
from tandem.runtime.speculative.factory import (
    SpecOptions,
    SpeculativeStrategy,
    build_strategy,
)

RUNTIMES = {"LlamaCppBackend": "llama.cpp", "TorchBackend": "torch", "OnnxBackend": "onnxruntime"}
"""What :attr:`Engine.kind` calls each backend class."""

T = TypeVar("T")
Notify = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


@dataclass
class Engine:
    """An open target, its strategy and everything they hold; a context manager.

    ``target`` generates, ``strategy`` is passed as ``generate(..., strategy=...)``;
    ``plan`` is the memory planner's plan (llama.cpp), ``torch_plan`` the torch engine's
    pricing, ``placement`` the measured placement choice, ``notes`` what the builder
    changed or chose and why (shown by the front ends).
    """

    spec: EngineSpec
    target: Backend
    strategy: SpeculativeStrategy
    kind: str
    """``llama.cpp``, ``torch`` or ``onnxruntime``: where the target runs."""
    plan: Plan | None = None
    torch_plan: TorchPlan | None = None
    placement: Choice | None = None
    drafter_backend: Backend | None = None
    """The drafter model's backend (owned here, for memory figures), if any."""
    notes: list[str] = field(default_factory=list)
    extras: list[Any] = field(default_factory=list)
    """Other things to close with the engine (the MoE offload manager)."""
    options: SpecOptions = field(default_factory=SpecOptions)
    """The options :attr:`strategy` was built with, placement's settings included."""

    kernels: KernelChoice | None = None
    """llama.cpp's configuration chosen for this machine (weights as stored or repacked)
    and why, when the spec left it to the machine."""

    def fresh_strategy(self, **changes: Any) -> SpeculativeStrategy:
        """Another strategy like :attr:`strategy` (its options with ``changes``), starting
        from nothing learnt in this process's earlier replies; the caller closes it.
        ``tandem bench`` runs each reply with one, so replies do not depend on each other."""
        return build_strategy(self.target, self.drafter_backend, replace(self.options, **changes))

    def describe(self) -> dict:
        """What runs where: target, engine, KV, drafting, placement (``--json``, ``/v1/models``)."""
        out: dict[str, Any] = {"target": self.target.name, "engine": self.kind, "n_ctx": self.target.n_ctx,
                               "speculation": self.strategy.describe(),
                               "exact_batch": self.target.exact_batch}  # None: not token-identical
        if self.plan is not None:
            out["kv_type"] = self.plan.target.type_k
            out["n_gpu_layers"] = self.plan.target.n_gpu_layers  # llama.cpp's count, the output layer first
            chosen = next((o for o in self.plan.placements if o.chosen), None)
            if chosen is not None:  # a target bigger than the GPU budget: how it was split
                out["offload"] = chosen.pin
        if self.spec.kv_compress is not None:
            out["kv_compress"] = self.torch_plan.kv_label if self.torch_plan else True
        if self.spec.moe_offload is not None and self.torch_plan is not None:
            out["moe_offload"] = self.torch_plan.offload_label
        if self.kernels is not None:
            out["kernels"] = self.kernels.as_dict()
        if self.placement is not None:
            out["placement"] = self.placement.as_dict()
        if self.notes:
            out["notes"] = list(self.notes)
        return out

    def close(self) -> None:
        """Strategy (its drafters), the drafter backend, extras, then the target."""
        self.strategy.close()
        for extra in reversed(self.extras):
            extra.close()
        self.extras = []
        if self.drafter_backend is not None:
            self.drafter_backend.close()
            self.drafter_backend = None
        self.target.close()
        if self.kernels is not None and self.kernels.pending:
            measure_later(self.spec.target, self.kernels.threads)
            self.kernels = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_engine(spec: EngineSpec, notify: Notify | None = None,
                on_load: Callable[[float], None] | None = None) -> Engine:
    """Plan, open, place and build the strategy for ``spec`` (module docstring).

    ``notify`` receives progress stages ("planning memory", "loading the model", ...),
    ``on_load`` the fraction of the target's weights loaded (a progress bar's, where the
    runtime reports it: llama.cpp);
    what the builder chose or changed (a drafter the planner dropped, a KV type it chose
    for the budget, a quality cost) is in ``Engine.notes``. Raises ``BudgetError``
    when nothing fits, ``TandemError`` for settings that cannot apply; on any failure
    everything opened so far is closed.
    """
    say = notify or _quiet
    kind = target_engine(spec)
    check_spec(spec, kind)
    if kind == "llama.cpp":
        return on_passing_thread(lambda: _open_llama(spec, say, on_load))
    return on_passing_thread(lambda: _open_other(spec, kind, say, on_load))


def on_passing_thread(fn: Callable[[], T]) -> T:
    """``fn()`` computed on a thread that ends when it returns (its exception re-raised).

    llama.cpp's CPU backend runs each graph as an OpenMP parallel region, and libgomp
    keeps a team of threads alive for every thread that has run one. Opening an engine
    computes (the verify-cost measurement); done on, say, a server's main thread, that
    team would outlive the load beside the generation thread's own, and with more OpenMP
    threads than cores libgomp stops spinning at barriers and sleeps instead: ~100
    context switches per token and 25 % slower decoding when every core is used
    (measured on the editor-autocomplete server). A passing thread takes its team with it."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # handed to the caller
            error.append(exc)

    thread = threading.Thread(target=run, name="tandem-open", daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def engine_for(target: Backend, spec: EngineSpec | None = None) -> Engine:
    """An :class:`Engine` around a target opened elsewhere (tests, benchmarks, a backend
    built by hand): no planning or placement, the strategy ``spec`` asks for (default:
    model-free drafting, ``auto``). The engine owns the target from here on."""
    spec = spec or EngineSpec(Path(target.name))
    try:
        drafter, strategy, options = on_passing_thread(
            lambda: _strategy(target, spec.drafter if _wants_model(spec) else None, spec_options(spec), None, None,
                              _quiet, threads=spec.threads))
    except BaseException:
        target.close()
        raise
    return Engine(spec, target, strategy, runtime_of(target), drafter_backend=drafter, options=options)


def runtime_of(target: Backend) -> str:
    """:attr:`Engine.kind` of an open target (:data:`RUNTIMES`, else its class name)."""
    return RUNTIMES.get(type(target).__name__, type(target).__name__)


def _close_all(*things: Any) -> None:
    """Close what a failed open had opened (``None``s skipped), last opened first."""
    for thing in reversed(things):
        if thing is not None:
            thing.close()


def _wants_model(spec: EngineSpec) -> bool:
    return spec.drafter is not None and spec.draft_mode in ("auto", "model", "xvocab")


def _planned_draft(spec: EngineSpec) -> Path | None:
    """The drafter the memory planner prices: a GGUF one the draft mode uses."""
    draft_path = spec.drafter if _wants_model(spec) else None
    return draft_path if draft_path is not None and backend_kind(draft_path) == "gguf" else None


def plan_llama(spec: EngineSpec) -> Plan:
    """The memory planner's plan for ``spec``'s GGUF target in llama.cpp, exactly as
    :func:`open_engine` makes it before loading (``BudgetError`` when nothing fits)."""
    return plan_for_run(spec.target, _planned_draft(spec), spec.budget, spec.n_ctx, vram=spec.vram,
                        threads=spec.threads, draft_max=spec.draft_max, drop_slow_draft=False, kv_type=spec.kv_type,
                        model_free=spec.draft_mode in ("auto", "ngram"), n_seq=spec.parallel,
                        moe_offload=spec.moe_offload is not None, offload=spec.offload)


def _open_llama(spec: EngineSpec, say: Notify, on_load: Callable[[float], None] | None) -> Engine:
    if spec.rpc:
        return _open_rpc(spec, say, on_load)
    draft_path = spec.drafter if _wants_model(spec) else None
    planned_draft = _planned_draft(spec)
    say("planning memory")
    plan = plan_llama(spec)
    notes = plan_notes(plan, planned_draft is not None)
    mode = spec.draft_mode
    if planned_draft is not None and plan.draft is None:
        draft_path = None
        if mode in ("model", "xvocab"):
            mode = "off"
    machine_choice = spec.repack is None and not spec.fast_verify and plan.target.n_gpu_layers == 0
    kernels = choose_kernels(spec.target, spec.threads or cpu_cores()) if machine_choice else None
    say("loading the model")
    target = open_backend(spec.target, llama_config=replace(plan.target.llama_config(), exact=not spec.fast_verify,
                                                               repack=kernels.repack if kernels else bool(spec.repack)),
                          on_load=on_load)
    placed = handed = None
    try:
        options = spec_options(spec, mode, plan.draft_max)
        llama_config = torch_config = None
        if plan.draft is not None:
            say("placing the drafter (measured on a pair's first run)")
            placed = place(target, plan, mode=mode, device=spec.placement, notify=say, keep_drafter=True)
            target, handed = placed.target, placed.draft_backend  # moved to the GPU when the target is placed there
            draft_path = Path(placed.draft_path)  # the file the planner priced (maybe a quantized copy)
            llama_config, torch_config = placed.llama_config, placed.torch_config
            options = replace(options, draft_window=plan.draft.window, draft_device=placed.draft_device,
                              predraft=placed.predraft, draft_cost=placed.draft_cost)
            if placed.choice is not None:
                notes.append(f"placement: {placed.choice.option.name} (measured"
                             + (", cached)" if placed.choice.cached else ")"))
        given, handed = handed, None  # _strategy owns it from here (and closes it on failure)
        drafter, strategy, options = _strategy(target, draft_path, options, llama_config, torch_config, say,
                                               threads=spec.threads, drafter=given)
    except BaseException:
        _close_all(target, handed)
        raise
    return Engine(spec, target, strategy, runtime_of(target), plan=plan, placement=placed.choice if placed else None,
                  drafter_backend=drafter, notes=notes, options=options, kernels=kernels)


def _open_rpc(spec: EngineSpec, say: Notify, on_load: Callable[[float], None] | None) -> Engine:
    """A target split over llama.cpp RPC servers (:mod:`tandem.runtime.backends.rpc`):
    each server's share priced against the memory it reports, this machine's against the
    budget less the drafter's (:mod:`tandem.runtime.planning.rpc_devices`). The drafter
    runs here on the CPU: there is no placement to measure."""
    # Local: llama_cpp and gguf load only when a GGUF target is opened.
    from tandem.runtime.backends.llama_config import LlamaConfig
    from tandem.runtime.planning.rpc_devices import plan_remote

    draft_path = spec.drafter if _wants_model(spec) else None
    kv = spec.kv_type or "f16"
    say("asking the RPC servers")
    split, n_ctx = plan_remote(spec.target, spec.rpc, n_ctx=spec.n_ctx, kv_type=kv, drafter=draft_path,
                               local_budget=None if spec.budget is None else parse_size(spec.budget))
    say("loading the model")
    config = LlamaConfig(n_ctx=n_ctx, n_threads=spec.threads, type_k=kv, type_v=kv, exact=not spec.fast_verify,
                         repack=bool(spec.repack), rpc=spec.rpc, rpc_layers=split.layers)
    target = open_backend(spec.target, llama_config=config, on_load=on_load)
    try:
        drafter, strategy, options = _strategy(target, draft_path, spec_options(spec),
                                               LlamaConfig(n_ctx=n_ctx, n_threads=spec.threads), None, say,
                                               threads=spec.threads)
    except BaseException:
        target.close()
        raise
    return Engine(spec, target, strategy, "llama.cpp", drafter_backend=drafter, notes=[split.summary()],
                  options=options)


def _open_other(spec: EngineSpec, kind: str, say: Notify, on_load: Callable[[float], None] | None) -> Engine:
    """A target in the torch engine (priced with its KV compression and expert offload) or
    onnxruntime (budget-checked): no ladder to walk, no placement to measure."""
    say("planning memory")
    torch_plan = None
    if kind == "torch":
        torch_plan = plan_torch(spec.target, budget=spec.budget, ctx=spec.n_ctx, device=spec.device,
                                draft_max=spec.draft_max, kv_compress=spec.kv_compress, moe=spec.moe_offload)
        say("loading the model")
        target = _open_torch(spec, torch_plan)
    else:
        plan_unplanned(spec.target, "onnx", spec.budget, spec.n_ctx)
        say("loading the model")
        target = open_backend(spec.target, n_ctx=spec.n_ctx, n_threads=spec.threads, on_load=on_load)
    extras: list[Any] = []
    try:
        if torch_plan is not None:
            extras = _apply_torch_options(target, torch_plan)
        drafter, strategy, options = _strategy(target, spec.drafter if _wants_model(spec) else None,
                                               spec_options(spec), None, None, say, threads=spec.threads)
    except BaseException:
        _close_all(target, *extras)
        raise
    return Engine(spec, target, strategy, kind, torch_plan=torch_plan, drafter_backend=drafter,
                  notes=torch_plan.notes() if torch_plan else [], extras=extras, options=options)


def _open_torch(spec: EngineSpec, torch_plan: TorchPlan) -> Backend:
    # Local: torch loads only when the torch engine runs (an optional extra).
    from tandem.runtime.backends.torch_engine.backend import TorchBackend, TorchConfig

    return TorchBackend(spec.target, TorchConfig(device=torch_plan.device, n_ctx=torch_plan.n_ctx,
                                                 n_threads=spec.threads, lazy_experts=torch_plan.offload is not None))


def _apply_torch_options(target: Backend, torch_plan: TorchPlan) -> list[Any]:
    """Swap in the compressed KV cache and put the experts behind their cache, as priced;
    returns what the engine must close with the target (the expert cache)."""
    # Local imports: torch loads only when the torch engine runs (an optional extra).
    if torch_plan.kv_compress is not None:
        from tandem.runtime.kv.compress import use_compressed_cache

        use_compressed_cache(target, torch_plan.kv_compress)
    if torch_plan.offload is not None:
        # local: loads torch only when this runs
        from tandem.runtime.moe.expert_cache import enable_offload

        # The experts were left in the file (TorchConfig.lazy_experts): the cache reads them from it.
        return [enable_offload(target, torch_plan.offload, source="gguf")]
    return []


def _strategy(target: Backend, draft_path: Path | None, options: SpecOptions, llama_config, torch_config,
              say: Notify, *, threads: int | None,
              drafter: Backend | None = None) -> tuple[Backend | None, SpeculativeStrategy, SpecOptions]:
    """The drafter backend (``drafter``, handed over by placement, or opened here with
    ``llama_config``, else the target's context and ``threads``; deferred to the first
    draft asked of it where :func:`deferred_draft_backend` can), the strategy, and the
    options it was built with. On failure the drafter backend is closed."""
    if options.mode == "off" or options.mode == "ngram":
        draft_path = None
    try:
        if draft_path is None and drafter is not None:
            drafter.close()
            drafter = None
        if draft_path is not None and drafter is None:
            if llama_config is None and backend_kind(draft_path) == "gguf":  # not planned: the target's context
                # Local: llama_cpp loads only when a GGUF model is opened.
                from tandem.runtime.backends.llama_config import LlamaConfig

                llama_config = LlamaConfig(n_ctx=target.n_ctx, n_threads=threads)
            # A drafter storing the target's vocabulary opens when first asked for a draft.
            drafter = deferred_draft_backend(target, draft_path, options, llama_config=llama_config)
            if drafter is None:
                say("loading the drafter")
                drafter = open_draft_backend(target, draft_path, llama_config=llama_config,
                                             device=options.draft_device, torch_config=torch_config)
        say("preparing speculative decoding")
        return drafter, build_strategy(target, drafter, options), options
    except BaseException:
        _close_all(drafter)
        raise


def plan_notes(plan: Plan, drafter_named: bool) -> list[str]:
    """What the planner changed that a user should hear about: a drafter it dropped, a KV
    type it chose for the budget."""
    notes = []
    if drafter_named and plan.draft is None:
        dropped = [r for r in plan.reasons if "draft model" in r or "drafter" in r]
        notes.append("memory planner: " + (dropped[-1] if dropped else "draft model dropped"))
    if plan.kv_note:
        notes.append("memory planner: " + plan.kv_note)
    return notes
