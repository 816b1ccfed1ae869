"""Fit a target + drafter pair to a memory budget, and say why.

The planner walks a ladder of options from best to most frugal and keeps the first that
fits, so the plan is the fastest one it knows to fit. The order follows what users lose:

1. lossless and nearly free: a smaller prefill batch for the target (only prefill slows);
2. the drafter shrinks before the target is touched (anchors §4/§8: incumbents OOM or
   silently cut the user's context because the drafter was not budgeted): a windowed
   draft context (acceptance barely moves), a q8_0 draft KV, fewer drafts per round;
   then the draft model is dropped (model-free drafting, which costs ~no memory, stays);
3. the target's KV cache goes to q8_0 (small quality cost, said so), again trying the
   drafter ladder first;
4. the context: an explicit ``--ctx`` is never shrunk — the plan fails and lists what
   would fit (the largest context, KV quantization, a smaller quant). A default context
   is shrunk with a stated reason.

Budgets cover the whole process: the planner adds the interpreter and libraries already
resident (measured now for this machine; :data:`PROFILE_BASELINE` for a profile).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from tandem.models.errors import BudgetError
from tandem.runtime.hardware import Machine, format_size, process_rss
from tandem.runtime.memory_model import Estimate, ModelShape, Setup, estimate, shape_from_gguf

PROFILE_BASELINE = 80 * 1024**2
"""Python, numpy, llama-cpp-python and the app, resident before any model (measured
~45 MiB for the CLI here; the TUI adds ~30 MiB)."""
SAFETY = 0.03
"""Share of the budget kept free for what the model does not see (allocator slack)."""
DECODE_EFFICIENCY = 0.6
"""Share of memory bandwidth a decode step achieves reading weights (llama.cpp CPU)."""
ACCEPTANCE_PRIOR = 0.7
"""Per-token acceptance assumed for a same-family model drafter before measuring."""
CPU_VERIFY_COST = (1.0, 1.7, 1.9, 2.1, 2.4, 2.55, 2.7, 2.85, 3.0)
"""c(k): a CPU verify of k drafts relative to one decode step (issue 3's measurement)."""
DRAFT_WINDOWS = (1024, 512, 256)
DRAFT_LENGTHS = (8, 4, 2)
MIN_CTX = 256


@dataclass(frozen=True)
class ModelPlan:
    path: str
    n_ctx: int
    n_batch: int = 256
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: bool = True
    n_gpu_layers: int = 0
    n_threads: int | None = None
    window: int | None = None
    """Drafter only: draft from the last ``window`` tokens (its own context cap)."""
    device: str = "cpu"
    """Drafter only: ``cuda`` runs it in the torch engine on the GPU (Dovetail placement)
    when llama.cpp here cannot offload; ``cpu`` is llama.cpp (with ``n_gpu_layers``)."""
    devices: tuple[str, ...] = ("cpu",)
    """Drafter only: every device it fits on. ``device`` is the planner's default; when
    there is more than one, :mod:`tandem.runtime.placement` picks between them from a
    measured calibration (cached) before generating."""

    def setup(self, output_rows: int = 1) -> Setup:
        return Setup(self.n_ctx, self.n_batch, self.type_k, self.type_v, self.flash_attn,
                     self.n_gpu_layers, output_rows)

    def llama_config(self):
        """The :class:`~tandem.runtime.llama_backend.LlamaConfig` that realises this plan."""
        from tandem.runtime.llama_backend import LlamaConfig

        return LlamaConfig(n_ctx=self.n_ctx, n_batch=self.n_batch, n_threads=self.n_threads,
                           n_gpu_layers=self.n_gpu_layers, type_k=self.type_k, type_v=self.type_v,
                           flash_attn=self.flash_attn)


@dataclass
class Plan:
    fits: bool
    machine: str
    host_budget: int
    vram_budget: int
    baseline: int
    target: ModelPlan
    draft: ModelPlan | None
    speculate: bool
    draft_max: int
    memory: Estimate
    tokens_per_s: float
    """Predicted plain decode speed."""
    speedup: float
    """Predicted speculative speedup over plain decoding (1.0 when not speculating)."""
    reasons: list[str] = field(default_factory=list)
    suggestions: list[str] = field(default_factory=list)

    @property
    def host_total(self) -> int:
        return self.baseline + self.memory.host

    def as_dict(self) -> dict:
        d = asdict(self)
        d["memory"] = self.memory.as_dict()
        d["memory"]["baseline_bytes"] = self.baseline
        d["memory"]["host_total_bytes"] = self.host_total
        d["speculative_tokens_per_s"] = self.tokens_per_s * self.speedup
        return d

    def check(self) -> Plan:
        """Raise :class:`BudgetError` (with the suggestions) when the plan does not fit."""
        if not self.fits:
            hint = "; ".join(self.suggestions) or "raise --budget"
            why = self.reasons[-1] if self.reasons else "The plan does not fit the budget"
            raise BudgetError(f"{why}. What would fit: {hint}.")
        return self


def _torch_gpu_ok(machine: Machine, d_shape: ModelShape, setup: Setup) -> bool:
    """Whether the drafter can run on a detected CUDA GPU through the torch engine
    (dequantized to fp32: weights and KV must fit the VRAM budget)."""
    gpu = machine.gpu
    if gpu is None or gpu.kind != "cuda" or machine.source != "detected":
        return False
    need = 4 * d_shape.n_params + 2 * d_shape.kv_bytes_per_token() * setup.n_ctx
    if need > machine.vram_budget:
        return False
    import torch

    return bool(torch.cuda.is_available())


def _gpu_ok(machine: Machine) -> bool:
    """Whether llama.cpp can offload layers here (a CUDA/Metal build) or in the profile."""
    if not machine.gpus or machine.vram_budget <= 0:
        return False
    if machine.source != "detected":
        return True
    import llama_cpp

    return bool(llama_cpp.llama_supports_gpu_offload())


def _fits(est: Estimate, machine: Machine, baseline: int) -> bool:
    host_room = machine.host_budget * (1 - SAFETY) - baseline
    gpu = machine.gpu
    if gpu is not None and gpu.unified:
        return est.host + est.gpu <= host_room and est.gpu <= machine.vram_budget
    return est.host <= host_room and est.gpu <= machine.vram_budget * (1 - SAFETY)


def _max_gpu_layers(shape: ModelShape, setup: Setup, machine: Machine, baseline: int, others: Estimate) -> int:
    """Most llama.cpp ``n_gpu_layers`` whose GPU share fits next to ``others``; -1 = all."""
    if not _gpu_ok(machine):
        return 0
    for g in [-1, *range(shape.n_layer, 0, -1)]:
        est = estimate(shape, replace(setup, n_gpu_layers=g))
        both = Estimate(est.items + others.items)
        if _fits(both, machine, baseline):
            return g
    return 0


def _decode_speed(shape: ModelShape, setup: Setup, machine: Machine) -> float:
    """Plain tokens/s: each step reads the weights and (on average) half the KV once."""
    est = estimate(shape, setup, include_process=False)

    def read(device: str) -> float:
        return sum(i.bytes * (0.5 if "KV" in i.label else 1.0) for i in est.items
                   if i.device == device and ("weights" in i.label or "KV" in i.label))

    t = read("host") / (machine.ram_bandwidth_gbs * 1e9 * DECODE_EFFICIENCY)
    if machine.gpu:
        t += read("gpu") / (machine.gpu.bandwidth_gbs * 1e9 * DECODE_EFFICIENCY)
    return 1.0 / max(t, 1e-9)


def predicted_speedup(alpha: float, k: int, c_draft: float, verify_cost: float) -> float:
    """§0: E[tokens/round] / (k·c + c_verify(k)), in units of one target step."""
    if k <= 0:
        return 1.0
    expected = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1
    return expected / (k * c_draft + verify_cost)


def _verify_cost(k: int, on_gpu: bool) -> float:
    if on_gpu:
        return 1.0 + 0.02 * k
    return CPU_VERIFY_COST[min(k, len(CPU_VERIFY_COST) - 1)] + 0.15 * max(0, k - len(CPU_VERIFY_COST) + 1)


@dataclass
class PlanRequest:
    target: Path
    draft: Path | None = None
    ctx: int | None = None
    """Context wanted; ``None`` means the model's own, capped at 4096 (may be shrunk)."""
    machine: Machine | None = None
    draft_max: int = 8
    threads: int | None = None
    allow_kv_quant: bool = True
    acceptance: float = ACCEPTANCE_PRIOR
    """Per-token acceptance of the drafter (measured, or the prior)."""
    drop_slow_draft: bool = True
    """Drop a drafter predicted to gain < 5 %. A drafter the user named explicitly is
    kept when it fits (``False``): the adaptive policy then turns drafting off at run
    time if it does not pay, using measured rather than predicted costs."""
    baseline: int | None = None
    """Resident bytes before the models load; ``None``: this process's RSS (or the
    profile constant when planning another machine)."""


def _ladder(t_shape: ModelShape, d_shape: ModelShape | None, ctx: int, draft_max: int):
    """Candidate (target plan fields, draft plan fields or None, k, note) from best to leanest."""
    for kv in ("f16", "q8_0"):
        if kv != "f16" and not t_shape.kv_type_ok(kv):
            continue
        for t_batch in (256, 64):
            if d_shape is not None:
                d_ctx_full = min(ctx, d_shape.n_ctx_train)
                yield kv, t_batch, (None, 256, "f16"), draft_max, "full drafter"
                for window in (w for w in DRAFT_WINDOWS if w < d_ctx_full):
                    yield kv, t_batch, (window, 64, "f16"), draft_max, f"draft window {window}"
                for k in (x for x in DRAFT_LENGTHS if x <= draft_max):
                    d_kv = "q8_0" if d_shape.kv_type_ok("q8_0") else "f16"
                    yield kv, t_batch, (min(DRAFT_WINDOWS[-1], d_ctx_full), 32, d_kv), k, "lean drafter"
            yield kv, t_batch, None, draft_max, "no draft model"


def make_plan(req: PlanRequest) -> Plan:
    """The fastest plan that fits ``req.machine``'s budgets (see the module docstring)."""
    machine = req.machine
    if machine is None:
        from tandem.runtime.hardware import resolve_machine

        machine = resolve_machine()
    baseline = req.baseline if req.baseline is not None else (
        process_rss() if machine.source == "detected" else PROFILE_BASELINE)
    t_shape = shape_from_gguf(req.target)
    d_shape = shape_from_gguf(req.draft) if req.draft else None
    explicit = req.ctx is not None
    # A default context leaves the k candidate cells inside what the model was trained on.
    ctx = req.ctx or max(MIN_CTX, min(t_shape.n_ctx_train, 4096) - req.draft_max)
    reasons: list[str] = []
    if ctx > t_shape.n_ctx_train:
        reasons.append(f"context {ctx} exceeds what {t_shape.name} was trained on ({t_shape.n_ctx_train})")
    while True:
        plan = _try_ctx(req, machine, baseline, t_shape, d_shape, ctx, reasons)
        if plan.fits or explicit or ctx <= MIN_CTX:
            break
        smaller = max(MIN_CTX, ctx // 2)
        reasons.append(f"the default context {ctx} does not fit the budget; trying {smaller}")
        ctx = smaller
    if not plan.fits:
        plan.suggestions = suggest(req, machine, baseline, t_shape, ctx)
    return plan


def _try_ctx(req: PlanRequest, machine: Machine, baseline: int, t_shape: ModelShape,
             d_shape: ModelShape | None, ctx: int, reasons: list[str]) -> Plan:
    gpu_ok = _gpu_ok(machine)
    for kv, t_batch, draft_cfg, k, note in _ladder(t_shape, d_shape, ctx, req.draft_max):
        if kv != "f16" and not req.allow_kv_quant:
            continue
        spec_k = k  # model-free drafting verifies k drafts too, with or without a draft model
        target = ModelPlan(str(req.target), ctx + spec_k, t_batch, kv, kv, n_threads=req.threads)
        draft = None
        d_est = Estimate()
        if draft_cfg is not None and d_shape is not None:
            window, d_batch, d_kv = draft_cfg
            d_ctx = (window or min(ctx, d_shape.n_ctx_train)) + k + 1
            draft = ModelPlan(str(req.draft), d_ctx, d_batch, d_kv, d_kv, n_threads=req.threads, window=window)
            if gpu_ok:  # Dovetail: the small drafter takes the GPU first, the target the rest
                g = _max_gpu_layers(d_shape, draft.setup(), machine, baseline, Estimate())
                draft = replace(draft, n_gpu_layers=g)
            elif _torch_gpu_ok(machine, d_shape, draft.setup()):
                draft = replace(draft, device="cuda", devices=("cuda", "cpu"))
            # A torch drafter on the GPU is still priced as host memory: an over-estimate
            # that keeps the host budget safe.
            d_est = estimate(d_shape, draft.setup(), include_process=False)
        t_setup = target.setup(spec_k + 1)
        g = _max_gpu_layers(t_shape, t_setup, machine, baseline, d_est) if gpu_ok else 0
        target = replace(target, n_gpu_layers=g)
        est = estimate(t_shape, target.setup(spec_k + 1), d_shape if draft else None,
                       draft.setup() if draft else None, k=spec_k)
        if not _fits(est, machine, baseline):
            continue
        return _finish(machine, baseline, t_shape, d_shape, target, draft, spec_k, est, note, reasons,
                       req.acceptance, req.drop_slow_draft)
    kv = _leanest_kv(t_shape, req.allow_kv_quant)
    est = estimate(t_shape, Setup(ctx, 64, kv, kv))
    reasons = [*reasons, f"{t_shape.name} alone needs {format_size(est.host + baseline)} of host memory "
               f"at context {ctx} (with {kv} KV and a small batch) but the budget is "
               f"{format_size(machine.host_budget)}"]
    return Plan(False, machine.describe(), machine.host_budget, machine.vram_budget, baseline,
                ModelPlan(str(req.target), ctx), None, False, 0, est, 0.0, 1.0, reasons)


def _finish(machine: Machine, baseline: int, t_shape: ModelShape, d_shape: ModelShape | None,
            target: ModelPlan, draft: ModelPlan | None, k: int, est: Estimate, note: str,
            reasons: list[str], alpha: float, drop_slow_draft: bool = True) -> Plan:
    reasons = list(reasons)
    speed = _decode_speed(t_shape, target.setup(), machine)
    speedup = 1.0
    if target.n_gpu_layers:
        reasons.append(f"target: {_layers(target.n_gpu_layers, t_shape)} on the GPU"
                       + ("" if _layers(target.n_gpu_layers, t_shape) == "all layers" else ", the rest on CPU threads"))
    else:
        reasons.append("target on CPU threads" + (" (no GPU offload in this llama.cpp build)"
                                                  if machine.gpus and not _gpu_ok(machine) else ""))
    if target.type_k != "f16":
        reasons.append(f"target KV cache quantized to {target.type_k}: f16 did not fit even without a "
                       "draft model (small quality cost)")
    if target.n_batch < 256:
        reasons.append(f"prefill batch {target.n_batch} to shrink the compute buffer (prefill is slower)")
    if draft is not None and d_shape is not None:
        d_speed = _decode_speed(d_shape, draft.setup(), machine)
        c = speed / d_speed
        # The adaptive policy picks the length at run time; k only caps it (and the memory).
        speedup = max(predicted_speedup(alpha, j, c, _verify_cost(j, bool(target.n_gpu_layers)))
                      for j in range(1, k + 1))
        where = "GPU" if draft.n_gpu_layers else "CPU"
        if draft.device == "cuda":
            where = "GPU through the torch engine (this llama.cpp build cannot offload; Dovetail placement)"
        reasons.append(f"drafter {d_shape.name} on the {where} ({note}), up to {k} drafts per round; "
                       f"cost ratio c = {c:.3f}")
        if draft.window:
            reasons.append(f"drafter context capped at {draft.window} tokens (drafts from a sliding window) "
                           "to fit the budget before touching the target's context")
        if speedup < 1.05:
            reasons.append(f"predicted speedup {speedup:.2f}x is too small: the draft model is not worth it here"
                           + ("" if drop_slow_draft else "; kept as asked, the adaptive policy switches "
                              "drafting off at run time if it does not pay"))
    elif d_shape is not None:
        reasons.append("draft model dropped: it does not fit next to the target; model-free drafting stays on")
    extra = est.speculation_extra()
    reasons.append(f"predicted memory {format_size(baseline + est.host)} host"
                   + (f" + {format_size(est.gpu)} GPU" if est.gpu else "")
                   + f" (speculation {format_size(extra)}) of a {format_size(machine.host_budget)} budget")
    if draft is not None and speedup < 1.05 and drop_slow_draft:
        draft, speedup = None, 1.0
        est = estimate(t_shape, target.setup(k + 1), k=k)
    return Plan(True, machine.describe(), machine.host_budget, machine.vram_budget, baseline, target,
                draft, draft is not None, k, est, speed, speedup, reasons)


def _leanest_kv(shape: ModelShape, allow_quant: bool) -> str:
    return "q8_0" if allow_quant and shape.kv_type_ok("q8_0") else "f16"


def _layers(g: int, shape: ModelShape) -> str:
    return "all layers" if g < 0 or g > shape.n_layer else f"{g}/{shape.n_layer} layers"


QUANT_BPW = {"q8_0": 8.5, "q6_k": 6.56, "q5_k_m": 5.69, "q4_k_m": 4.85, "q4_0": 4.5, "q3_k_m": 3.91}
"""Average bits per weight of common GGUF quantizations (llama.cpp's published sizes)."""


def suggest(req: PlanRequest, machine: Machine, baseline: int, t_shape: ModelShape, ctx: int) -> list[str]:
    """What would fit: the largest context, KV quantization, a smaller quant."""
    room = machine.host_budget * (1 - SAFETY) - baseline
    out: list[str] = []

    k = req.draft_max

    def target_only(c: int, kv: str, shape: ModelShape = t_shape) -> int:
        """The leanest rung of the ladder: no draft model, model-free drafts of k."""
        return estimate(shape, Setup(c + k, 64, kv, kv, output_rows=k + 1), k=k).host

    for kv in ("f16", "q8_0", "q4_0"):
        if not t_shape.kv_type_ok(kv):
            continue
        if target_only(ctx, kv) <= room:
            out.append(f"--kv {kv} at context {ctx}" + (" (q4_0 KV costs quality)" if kv == "q4_0" else ""))
            break
    lo, hi = 0, ctx
    while lo < hi:  # largest context that fits with the leanest KV allowed
        mid = (lo + hi + 1) // 2
        if target_only(mid, _leanest_kv(t_shape, req.allow_kv_quant)) <= room:
            lo = mid
        else:
            hi = mid - 1
    if lo >= 64:
        out.append(f"--ctx {lo} or less")
    for q, bpw in sorted(QUANT_BPW.items(), key=lambda kv: -kv[1]):
        scale = bpw / 8 / (t_shape.weights_bytes / max(t_shape.n_params, 1))
        if scale >= 0.9:
            continue
        smaller = replace(t_shape, layer_bytes=tuple(int(b * scale) for b in t_shape.layer_bytes),
                          input_bytes=int(t_shape.input_bytes * scale), output_bytes=int(t_shape.output_bytes * scale))
        if target_only(ctx, "f16", smaller) <= room:
            out.append(f"a {q.upper()} quant of the model (~{format_size(smaller.weights_bytes)} of weights)")
            break
    need = (baseline + target_only(ctx, "f16")) / (1 - SAFETY)
    out.append(f"--budget {format_size(need)} for context {ctx} without a draft model")
    return out


def plan_for_run(target_path: str | Path, draft_path: str | Path | None = None, budget: int | str | None = None,
                 ctx: int | None = None, *, vram: int | str | None = None, profile: str | None = None,
                 threads: int | None = None, draft_max: int = 8, acceptance: float = ACCEPTANCE_PRIOR,
                 drop_slow_draft: bool = True) -> Plan:
    """The one call ``tandem run`` / ``tandem chat`` make: plan for this machine (or a
    profile) and raise :class:`BudgetError` with suggestions when nothing fits.

    ``plan.target.llama_config()`` (and ``plan.draft.llama_config()`` when a draft model
    is kept) are the backends' configs; ``plan.draft_max`` caps the draft length, and
    ``plan.draft.window`` the drafter's context (wrap it in
    :class:`tandem.runtime.split.WindowedDrafter`).
    """
    import tandem.runtime.llama_backend  # noqa: F401  (resident before the baseline is read)
    from tandem.runtime.hardware import resolve_machine

    machine = resolve_machine(profile, budget, vram, measure_bandwidth=False)
    req = PlanRequest(Path(target_path), Path(draft_path) if draft_path else None, ctx, machine,
                      draft_max=draft_max, threads=threads, acceptance=acceptance,
                      drop_slow_draft=drop_slow_draft)
    return make_plan(req).check()
