"""Fit a target + drafter pair to a memory budget, and say why.

The planner walks a ladder of options from best to most frugal and keeps the first that
fits, so the plan is the fastest one it knows to fit. The order follows what users lose:

1. lossless and nearly free: a smaller prefill batch for the target (only prefill slows);
2. the drafter shrinks before the target is touched (anchors §4/§8: incumbents OOM or
   silently cut the user's context because the drafter was not budgeted): a windowed
   draft context (acceptance barely moves), a q8_0 draft KV, a small draft batch, fewer
   drafts per round; each rung is tried with the drafter's own weights and then with a
   Q8_0 copy of an F32/F16 drafter (made once by llama.cpp's quantizer, cached: the
   target verifies every token, so it changes speed, never the output); then the draft
   model is dropped (model-free drafting, which costs ~no memory, stays);
3. the target's KV cache goes to q8_0 (small quality cost, said so), again trying the
   drafter ladder first;
4. the context: an explicit ``--ctx`` is never shrunk — the plan fails and lists what
   would fit (the largest context, KV quantization, a smaller quant). A default context
   is shrunk with a stated reason.

A budget is the whole process's peak resident memory (RSS, what ``/usr/bin/time -f %M``
reports): the planner adds the process baseline — measured once per machine in a child
that imports what `tandem run` imports, cached (:mod:`tandem.runtime.planning.baseline`);
:data:`PROFILE_BASELINE` for a profile — and, when model-free drafting runs, its index
over the context. An explicit ``--ctx`` past what the model was trained for is refused.

Where the drafter runs: with a llama.cpp build that offloads, it takes GPU layers first.
Otherwise, on a detected CUDA GPU, it may run in the torch engine there, priced in VRAM
(float32 weights, its KV cache, a workspace, the CUDA context; see
:func:`tandem.runtime.planning.memory_model.torch_gpu_items`) under the ``--vram`` budget; the
plan lists every device it fits on (``ModelPlan.devices``).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from tandem.errors import TandemError
from tandem.runtime.planning.baseline import machine_baseline, measure_soon
from tandem.runtime.planning.devices import (
    SAFETY,
    fits,
    gpu_offload_ok,
    max_gpu_layers,
    place_draft,
    place_experts,
    torch_cuda_ok,
)
from tandem.runtime.planning.hardware import Machine, format_size, resolve_machine
from tandem.runtime.planning.ladder import draft_quant_copy, kv_candidates, ladder
from tandem.runtime.planning.llama_sizes import close_all, sizes_for
from tandem.runtime.planning.memory_model import Estimate, Item, Setup, estimate
from tandem.runtime.planning.memprobe import process_rss, unresident_code
from tandem.runtime.planning.offload import Pair, check_pin, compare, needs_comparing, summary
from tandem.runtime.planning.plan import (
    ACCEPTANCE_PRIOR,
    KV_QUALITY,
    ModelPlan,
    OffloadOption,
    Plan,
    PlanRequest,
    check_context,
)
from tandem.runtime.planning.shapes import ModelShape, shape_from_gguf
from tandem.runtime.planning.speed import predict
from tandem.runtime.planning.suggest import leanest_kv, suggest

PROFILE_BASELINE = 80 * 1024**2
"""Python, numpy, llama-cpp-python and the app, resident before any model (measured
~45 MiB for the CLI here; the TUI adds ~30 MiB)."""
MIN_CTX = 256


def detected_baseline() -> int:
    """Resident bytes of a `tandem run` process before its models, on this machine: the
    measured, cached baseline (:mod:`tandem.runtime.planning.baseline`), or this process's
    own resident size plus the llama.cpp code it will still fault in when that is
    larger (the chat app imports Textual; a test process holds much more)."""
    return max(machine_baseline().total, process_rss() + unresident_code())


def make_plan(req: PlanRequest) -> Plan:
    """The fastest plan that fits ``req.machine``'s budgets (see the module docstring)."""
    try:
        _measure_soon(req)
        return _make_plan(req)
    finally:
        close_all()  # the sizing children end with the plan; their answers are cached


def _measure_soon(req: PlanRequest) -> None:
    """Start every child process the plan will wait for (this machine's baseline,
    llama.cpp's sizes of each model) at once, when their caches lack them: on a first
    run they measure side by side instead of one after the other."""

    if req.baseline is None and (req.machine is None or req.machine.source == "detected"):

        measure_soon()
    for model in (req.target, req.draft):
        if model is not None and Path(model).is_file():
            sizes_for(model).start_soon()


def _make_plan(req: PlanRequest) -> Plan:
    machine = req.machine
    if machine is None:
        machine = resolve_machine()
    if req.baseline is not None:
        baseline = req.baseline
    elif machine.source == "detected":
        baseline = detected_baseline()
    else:
        baseline = PROFILE_BASELINE
    check_pin(req.offload)
    t_shape = shape_from_gguf(req.target)
    if req.moe_offload and not t_shape.expert_bytes:
        raise TandemError(f"{t_shape.name} is not a mixture-of-experts GGUF (no blk.N.ffn_*_exps tensors): "
                          "--moe-offload has no experts to keep in host memory.")
    d_shapes: dict[str | None, ModelShape] = {}
    quant = None
    if req.draft:
        d_shapes[None] = shape_from_gguf(req.draft)
        q = draft_quant_copy(req.draft, d_shapes[None])
        if q is not None:
            quant, d_shapes[quant] = q
    explicit = req.ctx is not None
    check_context(req.ctx, t_shape)
    # A default context leaves the k candidate cells inside what the model was trained on.
    ctx = wanted = req.ctx or max(MIN_CTX, min(t_shape.n_ctx_train, 4096) - req.draft_max)
    reasons: list[str] = []
    model_free = req.draft is not None if req.model_free is None else req.model_free
    per_token = draft_index_per_token(machine) if model_free else 0.0
    while True:
        # The model-free drafters' index grows with the context: priced with it, outside
        # the rungs (no rung changes it), and listed as its own row.
        index = int(per_token * (ctx + req.draft_max)) * req.n_seq  # each slot drafts from its own
        plan = _try_ctx(req, machine, baseline + index, t_shape, d_shapes, quant, ctx, reasons)
        if plan.fits or explicit or ctx <= MIN_CTX:
            break
        smaller = max(MIN_CTX, ctx // 2)
        reasons.append(f"the default context {ctx} does not fit the budget; trying {smaller}")
        ctx = smaller
    plan.baseline = baseline
    if plan.fits and plan.target.type_k != "f16":
        kv = plan.target.type_k
        chosen = next((o for o in plan.placements if o.chosen), None)
        if req.kv_type is not None:
            why = f"target KV cache {kv}, as asked ({KV_QUALITY[kv]})"
        elif chosen is not None and chosen.key == "c":
            why = (f"target KV cache quantized to {kv} to put more of its layers on the GPU (placement c, "
                   f"predicted {chosen.speculative_tokens_per_s:.1f} tok/s; {KV_QUALITY[kv]})")
            plan.kv_note = why
        else:
            why = f"target KV cache quantized to {kv}: f16 did not fit even without a draft model ({KV_QUALITY[kv]})"
            plan.kv_note = why
        plan.reasons.insert(1, why)
    if index:
        slots = f" x {req.n_seq} slots" if req.n_seq > 1 else ""
        row = Item(f"model-free drafting index (suffix trie and lookup, {ctx + req.draft_max} tokens{slots})",
                   "speculation", "host", index)
        plan.memory = Estimate((*plan.memory.items, row))
    if not plan.fits:
        # Suggestions are for the context asked for (or the default one), not the last one tried.
        index = int(per_token * (wanted + req.draft_max)) * req.n_seq
        plan.suggestions = suggest(machine.host_budget * (1 - SAFETY) - baseline - index, baseline + index, SAFETY,
                                   t_shape, wanted, req.draft_max, req.allow_kv_quant)
    return plan


MODEL_FREE_PER_TOKEN = 2500.0
"""Bytes per context token of the model-free drafters' index on a profile machine (the
suffix trie and prompt lookup with its undo log, at their worst: random tokens; measured
2.40-2.46 kB on CPython 3.11 x86-64). On this machine it is measured
(:mod:`tandem.runtime.planning.baseline`)."""


def draft_index_per_token(machine: Machine) -> float:
    if machine.source != "detected":
        return MODEL_FREE_PER_TOKEN
    return machine_baseline().draft_index_per_token


def _try_ctx(req: PlanRequest, machine: Machine, baseline: int, t_shape: ModelShape,
             d_shapes: dict[str | None, ModelShape], quant: str | None, ctx: int, reasons: list[str]) -> Plan:
    gpu_ok = gpu_offload_ok(machine)
    torch_cuda = bool(d_shapes) and not gpu_ok and torch_cuda_ok(machine)
    d_shape = d_shapes.get(None)
    for kv, t_batch, draft_cfg, k, note in ladder(t_shape, d_shape, ctx, req.draft_max, quant,
                                                   kv_candidates(t_shape, req)):
        # Model-free drafting verifies k drafts too, with or without a draft model.
        target = ModelPlan(str(req.target), ctx + k, t_batch, kv, kv, n_threads=req.threads, n_seq=req.n_seq)
        if draft_cfg is None or d_shape is None or req.draft is None:
            if req.moe_offload and t_shape.expert_bytes:
                g, n_home = place_experts(t_shape, target.setup(k + 1), machine, baseline, Estimate())
                target = replace(target, n_gpu_layers=g, host_expert_layers=n_home)
            else:
                g = max_gpu_layers(t_shape, target.setup(k + 1), machine, baseline, Estimate()) if gpu_ok else 0
                target = replace(target, n_gpu_layers=g)
            est = estimate(t_shape, target.setup(k + 1), k=k)
            if not fits(est, machine, baseline):
                continue
            placements: list[OffloadOption] = []
            if gpu_ok and not req.moe_offload and needs_comparing(target):
                target, _, est, placements = _compared(req, Pair(machine, baseline, t_shape, target, k,
                                                                 alpha=req.acceptance))
            _check_pinned(req, machine, placements)
            return _finish(machine, baseline, t_shape, d_shape, target, None, k, est, note, reasons,
                           req.acceptance, req.drop_slow_draft, placements=placements)
        window, d_batch, d_kv, q = draft_cfg
        d_ctx = (window or min(ctx, d_shape.n_ctx_train)) + k + 1
        path = str(req.draft)
        if q is not None:
            # local: loads the gguf package only when this runs
            from tandem.models.quantize import cached_copy_path

            path = str(cached_copy_path(req.draft, q))
        draft = ModelPlan(path, d_ctx, d_batch, d_kv, d_kv, n_threads=req.threads, window=window, quant=q,
                          source=str(req.draft) if q else None)
        placed = place_draft(machine, baseline, gpu_ok, torch_cuda, t_shape, target, k, d_shapes[q], draft,
                             req.moe_offload)
        if placed is None:
            continue
        target, draft, est = placed
        placements = []
        if gpu_ok and not req.moe_offload and needs_comparing(target):
            target, draft, est, placements = _compared(req, Pair(machine, baseline, t_shape, target, k, d_shapes[q],
                                                                 draft, req.acceptance))
        _check_pinned(req, machine, placements)
        return _finish(machine, baseline, t_shape, d_shapes[q], target, draft, k, est, note, reasons,
                       req.acceptance, req.drop_slow_draft, d_shape, placements)
    kv = leanest_kv(t_shape, req.allow_kv_quant)
    est = estimate(t_shape, Setup(ctx * req.n_seq, 64, kv, kv))
    reasons = [*reasons, f"{t_shape.name} alone needs {(est.host + baseline) / 2**20:.1f} MiB of host memory "
               f"at context {ctx}" + (f" for each of {req.n_seq} slots" if req.n_seq > 1 else "")
               + f" (with {kv} KV and a small batch) but the budget is "
               f"{machine.host_budget / 2**20:.1f} MiB, {SAFETY:.0%} of it kept free"]
    return Plan(False, machine.describe(), machine.host_budget, machine.vram_budget, baseline,
                ModelPlan(str(req.target), ctx), None, False, 0, est, 0.0, 1.0, reasons)


def _compared(req: PlanRequest, pair: Pair) -> tuple[ModelPlan, ModelPlan | None, Estimate, list[OffloadOption]]:
    """The placement :mod:`tandem.runtime.planning.offload` chooses for a target bigger than
    the GPU budget (target, drafter, memory), and every placement it compared."""
    placed = compare(pair, kv_candidates(pair.t_shape, req), req.allow_kv_quant, req.kv_type is not None,
                     req.offload)
    options = [p.option for p in placed]
    win = next((p for p in placed if p.option.chosen), None)
    if win is None:
        return pair.target, pair.draft, estimate(pair.t_shape, pair.target.setup(pair.k + 1), pair.d_shape,
                                                 pair.draft.setup() if pair.draft else None, k=pair.k), options
    return win.target, win.draft, win.memory, options


def _check_pinned(req: PlanRequest, machine: Machine, placements: list[OffloadOption]) -> None:
    """Refuse an ``--offload`` where no placements were compared: it would pin nothing."""
    if req.offload is None or placements:
        return
    if not gpu_offload_ok(machine):
        why = ("there is no GPU llama.cpp can offload to here (no GPU, no --vram, or a llama.cpp build "
               "without GPU offload)")
    elif req.moe_offload:
        why = "--moe-offload places a MoE target's experts itself"
    else:
        why = "the target fits the GPU budget whole"
    raise TandemError(f"--offload {req.offload} picks among the placements of a target bigger than the GPU budget, "
                      f"but {why}: leave --offload out.")


def _finish(machine: Machine, baseline: int, t_shape: ModelShape, d_shape: ModelShape | None,
            target: ModelPlan, draft: ModelPlan | None, k: int, est: Estimate, note: str,
            reasons: list[str], alpha: float, drop_slow_draft: bool = True,
            d_original: ModelShape | None = None, placements: list[OffloadOption] | None = None) -> Plan:
    reasons = list(reasons)
    predicted = predict(machine, t_shape, target.setup(), alpha, k, d_shape, draft.setup() if draft else None)
    speed, speedup = predicted.plain, predicted.speedup
    if target.n_gpu_layers:
        reasons.append(f"target: {_layers(target.n_gpu_layers, t_shape)} on the GPU"
                       + ("" if _layers(target.n_gpu_layers, t_shape) == "all layers" else ", the rest on CPU threads")
                       + "; flash attention on (GPU kernels differ by batch size: greedy speculative output"
                         " equals plain output except at near-ties)")
    else:
        reasons.append("target on CPU threads" + (" (no GPU offload in this llama.cpp build: `tandem plan "
                                                  "--profile rtx3060-laptop --vram SIZE` shows how a build that "
                                                  "offloads would place it)"
                                                  if machine.gpus and not gpu_offload_ok(machine) else ""))
    if placements:
        reasons.append(summary(placements))
    if target.host_expert_layers:
        reasons.append(f"experts of {target.host_expert_layers}/{len(t_shape.expert_layers)} layers in host memory "
                       f"({format_size(t_shape.host_expert_bytes(target.host_expert_layers))}), "
                       "the rest of every offloaded layer on the GPU")
    if target.n_batch < 256:
        reasons.append(f"prefill batch {target.n_batch} to shrink the compute buffer (prefill is slower)")
    if draft is not None and d_shape is not None:
        # The adaptive policy picks the length at run time; k only caps it (and the memory).
        c = predicted.draft_cost
        where = "GPU" if draft.n_gpu_layers else "CPU"
        if draft.device == "cuda":
            where = (f"GPU through the torch engine ({format_size(est.total('gpu', 'draft'))} of VRAM with "
                     "float32 weights and the CUDA context; this llama.cpp build cannot offload; Dovetail placement)")
        reasons.append(f"drafter {d_shape.name} on the {where} ({note}), up to {k} drafts per round; "
                       f"cost ratio c = {c:.3f}")
        if len(draft.devices) > 1:
            reasons.append("the drafter also fits on the CPU (llama.cpp): a measured calibration picks the faster")
        elif draft.device == "cpu" and machine.gpu is not None and machine.gpu.kind == "cuda" and not gpu_offload_ok(machine):
            reasons.append("the drafter's float32 copy for the GPU (torch engine) does not fit the GPU budget "
                           "or no CUDA device is usable: it stays on the CPU")
        if draft.quant and d_original is not None:
            reasons.append(f"drafter weights from a {draft.quant.upper()} copy ({format_size(d_shape.weights_bytes)} "
                           f"instead of {format_size(d_original.weights_bytes)}; made once with llama.cpp's "
                           "quantizer and cached): the target verifies every token, so the output is unchanged")
        if draft.window:
            reasons.append(f"drafter context capped at {draft.window} tokens (drafts from a sliding window) "
                           "to fit the budget before touching the target's context")
        if speedup < 1.05:
            reasons.append(f"predicted speedup {speedup:.2f}x is too small: the draft model is not worth it here"
                           + ("" if drop_slow_draft else "; kept as asked, the adaptive policy switches "
                              "drafting off at run time if it does not pay"))
    elif d_shape is not None:
        reasons.append("draft model dropped: it does not fit next to the target; model-free drafting stays on")
    if draft is not None and speedup < 1.05 and drop_slow_draft:
        draft, speedup = None, 1.0
        est = estimate(t_shape, target.setup(k + 1), k=k)
    extra = est.speculation_extra()
    reasons.append(f"predicted peak memory {format_size(baseline + est.host)} host"
                   + (f" + {format_size(est.gpu)} GPU" if est.gpu else "")
                   + f" (speculation {format_size(extra)}) of a {format_size(machine.host_budget)} budget")
    return Plan(True, machine.describe(), machine.host_budget, machine.vram_budget, baseline, target,
                draft, draft is not None, k, est, speed, speedup, reasons, placements=list(placements or ()))


def _layers(g: int, shape: ModelShape) -> str:
    """llama.cpp's ``n_gpu_layers`` in words: it counts the output layer, offloaded first."""
    if g < 0 or g > shape.n_layer:
        return "all layers"
    if g == 1:
        return f"the output layer (1/{shape.n_layer + 1} layers)"
    return f"{g}/{shape.n_layer + 1} layers (the output layer and the last {g - 1} of {shape.n_layer} blocks)"


def plan_for_run(target_path: str | Path, draft_path: str | Path | None = None, budget: int | str | None = None,
                 ctx: int | None = None, *, vram: int | str | None = None, profile: str | None = None,
                 threads: int | None = None, draft_max: int = 8, acceptance: float = ACCEPTANCE_PRIOR,
                 drop_slow_draft: bool = True, model_free: bool | None = None, kv_type: str | None = None,
                 n_seq: int = 1, moe_offload: bool = False, offload: str | None = None) -> Plan:
    """The one call ``tandem run`` / ``tandem chat`` make: plan for this machine (or a
    profile) and raise :class:`BudgetError` with suggestions when nothing fits.

    ``plan.target.llama_config()`` (and ``plan.draft.llama_config()``, or
    ``plan.draft.torch_config()`` on ``cuda``, when a draft model is kept) are the
    backends' configs; open the drafter from ``plan.draft.path``, which may be a
    quantized copy of the file asked for (made here, once, and cached);
    ``plan.draft_max`` caps the draft length, and ``plan.draft.window`` the drafter's
    context (wrap it in :class:`tandem.runtime.speculative.overlap.WindowedDrafter`).
    """
    import tandem.runtime.backends.llama  # noqa: F401  (resident before the baseline is read)
    machine = resolve_machine(profile, budget, vram, measure_bandwidth=False)
    req = PlanRequest(Path(target_path), Path(draft_path) if draft_path else None, ctx, machine,
                      draft_max=draft_max, threads=threads, acceptance=acceptance,
                      drop_slow_draft=drop_slow_draft, model_free=model_free, kv_type=kv_type, n_seq=n_seq,
                      moe_offload=moe_offload, offload=offload)
    plan = make_plan(req).check()
    if plan.draft is not None and plan.draft.quant and plan.draft.source:
        # local: loads the gguf package only when this runs
        from tandem.models.quantize import cached_copy

        plan.draft = replace(plan.draft, path=str(cached_copy(plan.draft.source, plan.draft.quant)))
    return plan


MOST_SLOTS = 4
"""The most parallel slots :func:`parallel_for` chooses on its own (``--parallel`` sets more)."""


def parallel_for(target_path: str | Path, budget: int | str | None = None, ctx: int | None = None, *,
                 vram: int | str | None = None, threads: int | None = None, draft_max: int = 8,
                 kv_type: str | None = None, most: int = MOST_SLOTS) -> int:
    """``tandem serve``'s default ``--parallel``: the most slots (up to ``most``) whose KV
    caches fit the budget beside the model, each at the context and KV type one slot
    alone would get, with the same prefill batch; 1 when a second does not fit. Parallel
    slots never cost a shorter context, a quantized KV cache or a slower prefill."""

    one = plan_for_run(target_path, None, budget, ctx, vram=vram, threads=threads, draft_max=draft_max,
                       model_free=True, kv_type=kv_type)
    machine = resolve_machine(None, budget, vram, measure_bandwidth=False)
    per_slot = one.target.n_ctx - one.draft_max
    for n in range(most, 1, -1):
        req = PlanRequest(Path(target_path), None, per_slot, machine, draft_max=one.draft_max, threads=threads,
                          model_free=True, kv_type=one.target.type_k, n_seq=n)
        plan = make_plan(req)
        if plan.fits and plan.target.n_batch >= one.target.n_batch:
            return n
    return 1
