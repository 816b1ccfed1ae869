"""What the memory planner is asked and what it answers: :class:`PlanRequest` in,
:class:`Plan` (one :class:`ModelPlan` per model) out, and the checks on a request.

The search that turns one into the other is :mod:`tandem.runtime.planning.planner`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from tandem.errors import BudgetError, TandemError
from tandem.runtime.planning.hardware import Machine
from tandem.runtime.planning.memory_model import Estimate, Setup
from tandem.runtime.planning.shapes import ModelShape

ACCEPTANCE_PRIOR = 0.7
"""Per-token acceptance assumed for a same-family model drafter before measuring."""
KV_QUALITY = {
    "f16": "no quality cost",
    "q8_0": "1.9x smaller than f16; next-token agreement with f16 1.000, KL 3.8e-6",
    "q4_0": "3.6x smaller than f16; next-token agreement with f16 0.938, KL 6.2e-4",
}
"""Quality cost of each llama.cpp KV type: teacher-forced over 256 tokens against f16 KV
on a 32-wide-head model (BENCHMARKS.md, "KV cache compression", llama.cpp KV types).
A quantized V cache also turns on flash attention, which ends llama.cpp's exact
configuration: greedy speculative output may then differ from plain decoding at a
near-tie."""


@dataclass(frozen=True)
class ModelPlan:
    path: str
    n_ctx: int
    n_batch: int = 256
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: bool = False
    """Asked for. Otherwise off on the CPU, as the backend's default: speculative output
    is then bit-identical to plain greedy output (a quantized V cache turns it on:
    llama.cpp needs it there). On a GPU it is on regardless: see :attr:`flash`."""
    n_gpu_layers: int = 0
    n_threads: int | None = None
    window: int | None = None
    """Drafter only: draft from the last ``window`` tokens (its own context cap)."""
    device: str = "cpu"
    """Drafter only: ``cuda`` runs it in the torch engine on the GPU (Dovetail placement)
    when llama.cpp here cannot offload; ``cpu`` is llama.cpp (with ``n_gpu_layers``)."""
    devices: tuple[str, ...] = ("cpu",)
    """Drafter only: every device it fits on. ``device`` is the planner's default; when
    there is more than one, :mod:`tandem.runtime.planning.placement` picks between them from a
    measured calibration (cached) before generating."""
    quant: str | None = None
    """Drafter only: ``path`` is a copy of ``source`` quantized to this type (cached in the
    user cache dir; :func:`plan_for_run` makes it if it is missing)."""
    source: str | None = None
    """Drafter only: the file the user named, when ``path`` is a quantized copy of it."""
    n_seq: int = 1
    """Target only: parallel sequences (the server's slots), each with ``n_ctx`` tokens of
    KV in its own stream. Priced as one context of ``n_seq * n_ctx``: the KV cache is
    exactly that, the compute buffer a little less (attention spans one stream)."""

    host_expert_layers: int = 0
    """Target only, a MoE GGUF with ``--moe-offload``: the experts of its first N expert
    blocks stay in host memory, the rest of each offloaded block on the GPU (-1: all)."""

    @property
    def flash(self) -> bool:
        """Flash attention: asked for, or any layer on a GPU. There the exact
        configuration buys nothing (CUDA's kernels compute a verify batch differently
        from one-token steps whatever the attention, so greedy speculative output equals
        plain output except at near-ties either way) and costs much: llama-cpp-python's
        default (flash attention on) prefilled 2.3x and decoded 1.8x faster than the
        flash-off configuration, Qwen2.5-Coder-1.5B shapes on an H200
        (``benchmarks/gpu_costs.py``, BENCHMARKS.md "Quantized GGUF on a GPU")."""
        return self.flash_attn or self.n_gpu_layers != 0

    def setup(self, output_rows: int = 1) -> Setup:
        return Setup(self.n_ctx * self.n_seq, self.n_batch, self.type_k, self.type_v, self.flash,
                     self.n_gpu_layers, output_rows, self.host_expert_layers)

    def llama_config(self):
        """The :class:`~tandem.runtime.backends.llama_config.LlamaConfig` that realises this plan."""
        # local: loads llama.cpp only when this runs
        from tandem.runtime.backends.llama_config import LlamaConfig

        return LlamaConfig(n_ctx=self.n_ctx, n_batch=self.n_batch, n_threads=self.n_threads,
                           n_gpu_layers=self.n_gpu_layers, type_k=self.type_k, type_v=self.type_v,
                           flash_attn=self.flash, n_seq=self.n_seq, host_expert_layers=self.host_expert_layers)

    def torch_config(self, device: str | None = None):
        """The :class:`~tandem.runtime.backends.torch_engine.backend.TorchConfig` the planner priced
        for a torch drafter on ``device`` (default: this plan's): same context and batch,
        so its KV cache and workspace stay what the VRAM budget was checked against."""
        # local: loads llama.cpp and torch only when this runs
        from tandem.runtime.backends.torch_engine.backend import TorchConfig

        return TorchConfig(device=device or self.device, n_ctx=self.n_ctx, n_batch=self.n_batch,
                           n_threads=self.n_threads)


@dataclass(frozen=True)
class OffloadOption:
    """One placement of a target bigger than the GPU budget, priced and predicted
    (:mod:`tandem.runtime.planning.offload`): the plan lists each, the winner marked."""

    key: str
    """``a`` (partial offload), ``b`` (target on CPU threads) or ``c`` (a quantized KV
    cache making room for more layers)."""
    name: str
    type_k: str
    """The target's KV cache type (K and V alike)."""
    fits: bool
    n_gpu_layers: int = 0
    """The target's llama.cpp ``n_gpu_layers`` (-1: all)."""
    draft_gpu_layers: int | None = None
    """The drafter's; ``None``: no draft model."""
    host_bytes: int = 0
    """Predicted peak host memory, the process baseline included."""
    gpu_bytes: int = 0
    tokens_per_s: float = 0.0
    """Predicted plain decode speed of the target placed this way."""
    speculative_tokens_per_s: float = 0.0
    """With the drafter placed this way (the plain speed when drafting cannot pay)."""
    quality: str = "no quality cost"
    allowed: bool = True
    """False when ruled out whatever its speed: by the request (``--no-kv-quant``, a fixed
    ``--kv-type``), or a quantized KV cache that puts no more layers on the GPU."""
    chosen: bool = False
    note: str = ""
    """Why it won, lost, does not fit or is not allowed."""

    @property
    def pin(self) -> str:
        """The name ``--offload`` pins this placement by (:data:`~tandem.runtime.choices.OFFLOAD_CHOICES`): its key,
        with the KV type for (c), which is compared once per quantized type."""
        return f"{self.key}-{self.type_k}" if self.key == "c" else self.key


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
    kv_note: str | None = None
    """Set when the planner quantized the target's KV cache on its own (no ``kv_type``
    asked for), because f16 did not fit or to put more layers on the GPU: the front
    ends say so."""
    placements: list[OffloadOption] = field(default_factory=list)
    """For a target bigger than the GPU budget, every placement compared (empty
    otherwise): :mod:`tandem.runtime.planning.offload`."""

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
    kv_type: str | None = None
    """The target's KV cache type, fixed (``--kv-type``); ``None``: the first of
    :data:`~tandem.runtime.choices.LLAMA_KV_TYPES` that fits (quantized only when f16 does not)."""
    acceptance: float = ACCEPTANCE_PRIOR
    """Per-token acceptance of the drafter (measured, or the prior)."""
    n_seq: int = 1
    """Parallel sequences of the target (``tandem serve --parallel``), each with the
    context's KV (:attr:`ModelPlan.n_seq`)."""
    drop_slow_draft: bool = True
    """Drop a drafter predicted to gain < 5 %. A drafter the user named explicitly is
    kept when it fits (``False``): the adaptive policy then turns drafting off at run
    time if it does not pay, using measured rather than predicted costs."""
    model_free: bool | None = None
    """Whether model-free drafting (suffix trie, prompt lookup) runs, whose index grows
    with the context; ``None``: when a draft model is named (``--draft-mode auto``)."""
    baseline: int | None = None
    """Resident bytes before the models load; ``None``: this process's RSS plus the
    llama.cpp code it will still fault in (:func:`tandem.runtime.planning.memprobe.unresident_code`),
    or the profile constant when planning another machine."""
    moe_offload: bool = False
    """A MoE GGUF target on a GPU: keep the experts of as few blocks as it takes in host
    memory for everything else to fit the VRAM budget (``--moe-offload``)."""
    offload: str | None = None
    """For a target bigger than the GPU budget, the placement to take (one of
    :data:`~tandem.runtime.choices.OFFLOAD_CHOICES`, ``--offload``) instead of the fastest predicted; it must be
    compared, fit and be allowed, or the plan is refused (never another one instead).
    ``tandem bench --gpu --vram`` opens each placement this way."""



def check_context(ctx: int | None, shape: ModelShape) -> None:
    """Refuse a context longer than the model was trained for: past it, positions the
    model never saw make its output degrade into noise (no RoPE scaling is configured),
    and the memory for it would be spent on that. (The k draft slots the planner adds
    past a context at the limit are fine: llama.cpp only warns.)"""
    if ctx is not None and ctx > shape.n_ctx_train:
        raise TandemError(f"--ctx {ctx} is longer than {shape.name} was trained for ({shape.n_ctx_train} tokens); "
                          f"use --ctx {shape.n_ctx_train} or less.")
    if ctx is not None and ctx < 1:
        raise TandemError(f"--ctx {ctx} must be a positive number of tokens.")
