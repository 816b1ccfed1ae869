"""Pricing a target in the torch engine, with its KV compression and MoE expert offload.

The llama.cpp planner (:mod:`tandem.runtime.planning.planner`) walks a ladder of knobs;
the torch engine has two of its own, chosen by the user, so here they are priced rather
than searched: the memory model's torch rows (:func:`tandem.runtime.planning.memory_model.estimate`,
``kind="torch"``; :func:`~tandem.runtime.planning.memory_model.torch_gpu_items` on CUDA)
with

* the KV cache (and the heap glibc keeps for it) replaced by what the compressed cache
  holds at the context (:func:`tandem.runtime.kv.config.held_bytes`);
* the experts replaced by the offload cache's budget (plus int4 copies with
  ``low_bits``): the engine leaves them in the GGUF file while loading
  (``TorchConfig.lazy_experts``) and the cache reads them from its memory map; the
  *peak* is the larger of loading and running, and both are shown. (The file's pages
  read on misses are page cache: reclaimable, not counted.)

:func:`plan_torch` refuses (``BudgetError``) when the peak does not fit, naming the
options that would; every quality cost is the measured one (BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from tandem.errors import BudgetError, TandemError
from tandem.runtime.kv.config import PRESETS, KVCompressConfig, held_bytes
from tandem.runtime.moe.config import SPEED_NOTE, MoeOffloadSpec, OffloadConfig
from tandem.runtime.planning.devices import SAFETY
from tandem.runtime.planning.hardware import format_size, parse_size, resolve_machine
from tandem.runtime.planning.memory_model import Estimate, Item, Setup, estimate, torch_gpu_items
from tandem.runtime.planning.memprobe import process_rss, unresident_code
from tandem.runtime.planning.planner import PROFILE_BASELINE
from tandem.runtime.planning.shapes import ModelShape, shape_from_gguf, shape_from_hf

TORCH_BATCH = 512
"""The torch engine's prefill chunk (``TorchConfig.n_batch``)."""
LOW_BIT_SHARE = 1 / 7
"""Bytes of an expert's int4 copy relative to float32 (BENCHMARKS.md: "1/7 of the bytes")."""


@dataclass
class TorchPlan:
    """What a torch-engine target will hold, and what its options cost."""

    path: str
    device: str
    n_ctx: int
    memory: Estimate
    """Steady state (after loading)."""
    load_peak: int
    """Bytes resident on the model's device while loading (every weight dequantized)."""
    baseline: int
    host_budget: int
    vram_budget: int
    kv_compress: KVCompressConfig | None = None
    kv_label: str | None = None
    offload: OffloadConfig | None = None
    offload_label: str | None = None
    expert_bytes: int = 0
    quality: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def host_peak(self) -> int:
        host = self.memory.host if self.on_gpu else max(self.memory.host, self.load_peak)
        return self.baseline + host

    @property
    def gpu_peak(self) -> int:
        return max(self.memory.gpu, self.load_peak) if self.on_gpu else 0

    def notes(self) -> list[str]:
        """Quality costs of the chosen options (what the front ends print)."""
        return list(self.quality)

    def as_dict(self) -> dict:
        return {"engine": "torch", "device": self.device, "n_ctx": self.n_ctx, "kv_compress": self.kv_label,
                "moe_offload": self.offload_label, "expert_bytes": self.expert_bytes,
                "memory": self.memory.as_dict(), "load_peak_bytes": self.load_peak, "baseline_bytes": self.baseline,
                "host_peak_bytes": self.host_peak, "gpu_peak_bytes": self.gpu_peak, "quality": self.quality,
                "reasons": self.reasons}


def float32_shape(shape: ModelShape) -> ModelShape:
    """``shape`` with its weights as the torch engine holds them (float32, dequantized),
    and no GGUF file to price from llama.cpp's own sizes."""
    weights = shape.weights_bytes
    scale = 4 * shape.n_params / weights if shape.n_params and weights else 1.0
    return replace(shape, layer_bytes=tuple(int(b * scale) for b in shape.layer_bytes),
                   input_bytes=int(shape.input_bytes * scale), output_bytes=int(shape.output_bytes * scale),
                   weight_type="f32", path=None, file_bytes=0)


def torch_shape(path: Path) -> ModelShape:
    return float32_shape(shape_from_gguf(path)) if path.is_file() else shape_from_hf(path)


def expert_bytes(path: Path) -> int:
    """Float32 bytes of a GGUF model's routed experts (``ffn_*_exps``); 0 for a dense model."""
    if not path.is_file():
        return 0
    # local: loads the gguf package only when this runs
    from tandem.models.gguf_file import inspect_gguf

    total = 0
    for t in inspect_gguf(path).tensors:
        if "_exps." in t.name:
            n = 1
            for d in t.shape:
                n *= int(d)
            total += 4 * n
    return total


def kv_label(cfg: KVCompressConfig) -> str:
    return next((name for name, p in PRESETS.items() if p.config == cfg), "custom")


def _compressed(items: list[Item], shape: ModelShape, cfg: KVCompressConfig, n_ctx: int) -> list[Item]:
    """The target's KV rows (and glibc's retained heap, which scales with them) priced as ``cfg`` holds them."""
    full = sum(i.bytes for i in items if i.role == "target" and "KV cache" in i.label)
    held = held_bytes(cfg, n_layer=shape.n_layer, n_head_kv=shape.n_head_kv, head_dim=shape.head_dim,
                      n_tokens=n_ctx, pass_tokens=min(TORCH_BATCH, n_ctx))
    ratio = held / max(full, 1)
    out = []
    for i in items:
        if i.role == "target" and "KV cache" in i.label:
            i = replace(i, label=f"target KV cache ({kv_label(cfg)} compression, {n_ctx} tokens)", bytes=held)
        elif i.role == "target" and "heap kept by glibc" in i.label:
            i = replace(i, bytes=int(i.bytes * ratio))
        out.append(i)
    return out


def _offloaded(items: list[Item], device: str, experts: int, cfg: OffloadConfig) -> list[Item]:
    resident = min(cfg.budget_bytes, experts) + (int(experts * LOW_BIT_SHARE) if cfg.mixed_precision else 0)
    out = []
    for i in items:
        if i.role == "target" and "weights" in i.label and i.device == device:
            i = replace(i, label=i.label + ", experts offloaded", bytes=i.bytes - experts)
        out.append(i)
    out.append(Item(f"expert cache ({format_size(cfg.budget_bytes)} of {format_size(experts)} of experts, "
                    f"{cfg.eviction.upper()}" + (", int4 copies" if cfg.mixed_precision else "") + ")",
                    "target", device, resident))
    return out


def plan_torch(path: str | Path, *, budget: int | str | None = None, ctx: int | None = None,
               device: str | None = None, draft_max: int = 8, kv_compress: KVCompressConfig | None = None,
               moe: MoeOffloadSpec | None = None, vram: int | str | None = None, profile: str | None = None,
               baseline: int | None = None, check: bool = True) -> TorchPlan:
    """Price ``path`` (a GGUF file or Hugging Face folder) in the torch engine on
    ``device`` (``None``: CUDA when torch sees a GPU) with the given options, and raise
    :class:`BudgetError` when its peak does not fit (unless ``check`` is off)."""
    path = Path(path)
    machine = resolve_machine(profile, budget, vram, measure_bandwidth=False)
    if device is None:
        device = "cuda" if machine.source == "detected" and _cuda() else "cpu"
    shape = torch_shape(path)
    if ctx is not None and ctx > shape.n_ctx_train:
        raise TandemError(f"--ctx {ctx} is longer than {shape.name} was trained for ({shape.n_ctx_train} tokens); "
                          f"use --ctx {shape.n_ctx_train} or less.")
    n_ctx = ctx or min(shape.n_ctx_train, 4096)
    setup = Setup(n_ctx, TORCH_BATCH, "f32", "f32", output_rows=draft_max + 1)
    on_gpu = device.startswith("cuda")
    est = estimate(shape, setup, k=draft_max, kind="torch")
    items = list(est.items)
    if on_gpu:  # the model on the GPU, its host side and the speculation buffers on the host
        items = [i for i in items if i.role != "target"] + torch_gpu_items(shape, setup, role="target")
    where = "gpu" if on_gpu else "host"
    quality: list[str] = []
    reasons = [f"target {shape.name} in the torch engine on {device.upper() if on_gpu else 'the CPU'} "
               f"(float32 weights, {format_size(shape.weights_bytes)})"]
    if kv_compress is not None:
        items = _compressed(items, shape, kv_compress, n_ctx)
        label = kv_label(kv_compress)
        measured = PRESETS[label].measured.describe() if label in PRESETS else "not benchmarked (custom setting)"
        quality.append(f"KV compression {label}: {measured}")
    offload = None
    experts = 0
    if moe is not None:
        experts = expert_bytes(path)
        if not experts:
            raise TandemError(f"{shape.name} is not a mixture-of-experts GGUF: --moe-offload has nothing to offload.")
        offload = moe.config(cache_budget(moe.budget, experts))
        items = _offloaded(items, where, experts, offload)
        quality.append(f"MoE offload: {moe.quality()}; {SPEED_NOTE}")
        reasons.append(f"experts {format_size(experts)} stay in the GGUF file (mapped, read on a miss); "
                       f"{format_size(offload.budget_bytes)} of them cached on the {where}")
    # Loading holds the weights it dequantizes (not the experts an offload leaves in the file)
    # before any KV cache or expert is touched.
    load_peak = sum(i.bytes for i in items if i.device == where and i.role in ("target", "runtime")
                    and not any(x in i.label for x in ("KV cache", "heap kept", "expert cache")))
    if baseline is None:
        baseline = _baseline(machine)
    plan = TorchPlan(str(path), device, n_ctx, Estimate(tuple(i for i in items if i.bytes)), load_peak, baseline,
                     machine.host_budget, machine.vram_budget, kv_compress,
                     kv_label(kv_compress) if kv_compress else None, offload,
                     f"{moe.budget} {moe.eviction}" if moe else None, experts, quality, reasons)
    if check:
        check_fits(plan)
    return plan


def cache_budget(text: str, experts: int) -> int:
    """An expert cache budget: a size (``2GiB``) or a share of all experts (``25%``)."""
    text = text.strip()
    if text.endswith("%"):
        share = float(text[:-1]) / 100
        if not 0 < share <= 1:
            raise TandemError(f"--moe-offload {text}: a share must be between 0 and 100 %.")
        return max(1, int(experts * share))
    return parse_size(text)


def check_fits(plan: TorchPlan) -> None:
    room = plan.host_budget * (1 - SAFETY)
    if plan.host_peak <= room and (not plan.on_gpu or plan.gpu_peak <= plan.vram_budget * (1 - SAFETY)):
        return
    where = (f"{format_size(plan.gpu_peak)} of GPU memory over {format_size(plan.vram_budget)}"
             if plan.host_peak <= room else
             f"{format_size(plan.host_peak)} of host memory over the budget of {format_size(plan.host_budget)}")
    hints = []
    if plan.kv_compress is None:
        hints.append("--kv-compress cake+kivi4 (or another setting: `tandem plan --engine torch` lists them)")
    hints.append("a smaller --ctx")
    hints.append("--engine llama.cpp for a GGUF (quantized weights, --kv-type q8_0)")
    raise BudgetError(f"{Path(plan.path).name} in the torch engine at context {plan.n_ctx} needs {where}, "
                      f"{SAFETY:.0%} kept free. What would fit: {'; '.join(hints)}.")


def _cuda() -> bool:
    import torch  # local: the [torch] extra, seconds to import

    return bool(torch.cuda.is_available())


def _baseline(machine) -> int:
    """This process's resident bytes with torch imported (``import torch`` is hundreds of
    MB, in the baseline as the memory model expects), or the profile's."""
    if machine.source != "detected":
        return PROFILE_BASELINE
    import tandem.runtime.backends.torch_engine.backend  # noqa: F401
    return process_rss() + unresident_code()
