"""Where the drafter (and the target) run, and whether drafting overlaps verification,
chosen from measured per-device costs.

The memory planner says which devices a drafter *fits* on (``plan.draft.devices``); which
placement is *faster* depends on the machine, so it is measured (Dovetail, algorithms.md
§2) by :mod:`tandem.runtime.planning.calibration` once per pair and machine, and cached.
The options:

* drafter on the GPU (torch engine), target on CPU threads, with or without pre-drafting;
* the reverse: target on the GPU (torch engine), drafter on CPU threads — offered when
  llama.cpp here cannot offload and the dequantized target fits the VRAM budget;
* both on the CPU in turn, or on disjoint thread groups with pre-drafting.

Each is priced with the round model the speculative loop obeys, at draft length ``k``:

* in turn: a round costs ``k·t_draft + t_verify`` and yields ``E(α, k)`` tokens;
* pre-drafting (PEARL): when the round accepts everything and the drafter guessed the
  bonus token (probability ``α^(k+1)``), the next round was drafted during verification
  and the round costs ``max(t_verify, (k+1)·t_draft)``; otherwise a sequential round.

The target verifies every token, so the output is the target's greedy output in every
placement. One caveat: a target moved to the GPU runs in the torch engine, whose float32
arithmetic on the dequantized weights may break a rare near-tie differently from
llama.cpp's quantized dot products, so "the target" then means that engine's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from tandem.errors import TandemError
from tandem.kernels.acceptance import expected_tokens
from tandem.models.extras import installed
from tandem.runtime.backends.protocol import Backend
from tandem.runtime.machine import cpu_cores
from tandem.runtime.planning.costs import TORCH_CUDA_DEVICE, TORCH_CUDA_HOST
from tandem.runtime.planning.memory_model import Setup, torch_gpu_items
from tandem.runtime.planning.shapes import shape_from_gguf

CALIBRATION_K = 4
"""Draft length the options are compared at (the adaptive policy still picks k later)."""
CALIBRATION_TOKENS = 24
"""Target tokens generated to time decode steps and to score drafts against."""


@dataclass(frozen=True)
class Option:
    """One way to run the pair: devices, thread counts, and pre-drafting."""

    name: str
    draft_device: str
    target_threads: int
    draft_threads: int
    predraft: bool
    target_device: str = "cpu"


def target_key(o: Option) -> str:
    return "cuda" if o.target_device == "cuda" else f"cpu/{o.target_threads}"


def draft_key(device: str, threads: int) -> str:
    return "cuda" if device == "cuda" else f"cpu/{threads}"


@dataclass
class Costs:
    """Measured seconds, keyed ``cpu/<threads>`` or ``cuda``."""

    decode_s: dict[str, float] = field(default_factory=dict)
    """target -> one decode step."""
    verify_s: dict[str, float] = field(default_factory=dict)
    """target -> one verification of ``CALIBRATION_K`` drafts."""
    draft_s: dict[str, float] = field(default_factory=dict)
    """drafter -> seconds per drafted token."""
    acceptance: dict[str, float] = field(default_factory=dict)
    """drafter device -> greedy acceptance rate of drafted tokens."""


@dataclass
class Choice:
    option: Option
    predicted: dict[str, float]
    """option name -> predicted tokens/s."""
    plain: float
    """predicted tokens/s of the target alone where the chosen option puts it."""
    costs: Costs
    cached: bool = False

    def as_dict(self) -> dict:
        return {"placement": self.option.name, **{k: v for k, v in asdict(self.option).items() if k != "name"},
                "cached": self.cached, "predicted_tokens_per_s": {k: round(v, 2) for k, v in self.predicted.items()},
                "predicted_plain_tokens_per_s": round(self.plain, 2), "costs": asdict(self.costs)}


def options(devices: Sequence[str], threads: int, *, target_gpu: bool = False) -> list[Option]:
    """Options worth comparing for a drafter that fits on ``devices`` with ``threads`` cores
    (``target_gpu``: the target may run on the GPU instead)."""
    out: list[Option] = []
    if "cuda" in devices:
        out += [Option("drafter on GPU, pre-drafting", "cuda", threads, threads, True),
                Option("drafter on GPU", "cuda", threads, threads, False)]
    if target_gpu and "cpu" in devices:
        out += [Option("target on GPU, drafter on CPU, pre-drafting", "cpu", threads, threads, True, "cuda"),
                Option("target on GPU, drafter on CPU", "cpu", threads, threads, False, "cuda")]
    if "cpu" in devices:
        out.append(Option("drafter on CPU, sequential", "cpu", threads, threads, False))
        if threads >= MIN_SPLIT_THREADS:
            for d in sorted({1, threads // 4}):
                if 1 <= d < threads:
                    out.append(Option(f"CPU split {threads - d}+{d}, pre-drafting", "cpu", threads - d, d, True))
    return out


MIN_SPLIT_THREADS = 8
"""Fewer cores than this and splitting them between target and drafter never pays (on
2 cores the 1+1 split ran at 0.83x of in-turn: halving the target's threads slows
verification more than overlap saves), so a CPU-only machine that small has a single
option and its first run with a drafter measures nothing."""


def predict(option: Option, costs: Costs, k: int = CALIBRATION_K) -> float:
    """Predicted tokens/s of ``option`` from the measured costs (module docstring's model)."""
    verify = costs.verify_s[target_key(option)]
    step = costs.draft_s[draft_key(option.draft_device, option.draft_threads)]
    alpha = costs.acceptance[option.draft_device]
    sequential = k * step + verify
    if option.predraft:
        hit = alpha ** (k + 1)
        round_s = hit * max(verify, (k + 1) * step) + (1 - hit) * sequential
    else:
        round_s = sequential
    return expected_tokens(alpha, k) / round_s


def choose(opts: Sequence[Option], costs: Costs) -> Choice:
    predicted = {o.name: predict(o, costs) for o in opts}
    best = max(opts, key=lambda o: predicted[o.name])
    return Choice(best, predicted, 1.0 / costs.decode_s[target_key(best)], costs)


def target_gpu_fits(plan) -> bool:
    """Whether the target may run on the GPU through the torch engine: a CUDA GPU torch
    can use, a llama.cpp plan with no layers offloaded (a build that can offload does it
    itself), the dequantized target (and a drafter already planned there) inside the VRAM
    budget, and room in the host budget for the float32 copy made while loading."""
    if plan.target.n_gpu_layers or not plan.vram_budget or not installed("torch"):
        return False  # torch is an extra: without it there is no torch engine to place
    import torch  # local: seconds to import, and only a GPU plan asks

    if not torch.cuda.is_available():
        return False
    shape = shape_from_gguf(plan.target.path)
    cfg = plan.target
    items = torch_gpu_items(shape, Setup(cfg.n_ctx, cfg.n_batch, output_rows=plan.draft_max + 1), role="target")
    vram = sum(i.bytes for i in items if i.device == "gpu")
    host = sum(i.bytes for i in items if i.device == "host") + 4 * shape.n_params  # float32 copy while loading
    if not plan.memory.gpu:  # the first CUDA user in this process pays the context
        vram += TORCH_CUDA_DEVICE
        host += TORCH_CUDA_HOST
    return plan.memory.gpu + vram <= plan.vram_budget and host <= plan.host_budget - plan.host_total


@dataclass
class Placed:
    """What generation needs from the planned, chosen placement."""

    target: Backend | None = None
    """The target to generate with: the one given, or its replacement on the GPU."""
    draft_path: str | None = None
    """The drafter file the planner priced (maybe its quantized copy); ``None``: as given."""
    llama_config: object | None = None
    """The drafter's :class:`~tandem.runtime.backends.llama_config.LlamaConfig` with its thread count."""
    torch_config: object | None = None
    """The :class:`~tandem.runtime.backends.torch_engine.backend.TorchConfig` priced for a GPU drafter."""
    draft_device: str = "cpu"
    predraft: bool | None = None
    """``None`` leaves the strategy's default (on for a GPU drafter)."""
    choice: Choice | None = None
    """The calibration behind it; ``None`` when there was only one option."""
    draft_cost: float | None = None
    """Measured drafter seconds per token / target decode step, for the adaptive policy."""
    draft_backend: Backend | None = None
    """The drafter's backend the calibration opened on the chosen device, handed over
    (``place(keep_drafter=True)``) so it is not opened twice; the caller closes it."""


def plan_options(plan, device: str = "auto") -> list[Option]:
    """The options for ``plan`` (a :class:`~tandem.runtime.planning.planner.Plan` with a drafter) on
    this machine, restricted by ``device`` (see :data:`~tandem.runtime.choices.DEVICE_CHOICES`); a
    :class:`~tandem.errors.TandemError` when the restriction leaves none."""
    draft = plan.draft
    target_gpu = device in ("auto", "target-gpu") and target_gpu_fits(plan)
    if device == "target-gpu" and not target_gpu:
        raise TandemError("The target cannot run on the GPU here: it needs a CUDA GPU usable by torch and room "
                          "for its float32 weights in the VRAM budget.")
    wanted = {"auto": draft.devices, "gpu": ("cuda",), "cpu": ("cpu",), "target-gpu": ("cpu",)}[device]
    devices = tuple(d for d in draft.devices if d in wanted)
    if not devices:
        raise TandemError(f"The drafter cannot run on the {device.upper()} here: the plan allows "
                          f"{', '.join(draft.devices)}.")
    opts = options(devices, draft.n_threads or cpu_cores(), target_gpu=target_gpu)
    return [o for o in opts if o.target_device == "cuda"] if device == "target-gpu" else opts
