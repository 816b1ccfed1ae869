"""Every memory technique a target can use, with what it saves and what it costs in
quality, for `tandem plan` to list next to the plan it chose.

* llama.cpp: the KV cache type (``--kv-type f16|q8_0|q4_0``);
* the torch engine (``--engine torch``): float32 weights, the compressed KV cache
  settings (``--kv-compress``) and, for a mixture-of-experts GGUF, expert offload
  (``--moe-offload``).

Bytes come from the same memory model the planner uses; quality costs are the measured
ones (BENCHMARKS.md), never guesses.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tandem.runtime.choices import LLAMA_KV_TYPES
from tandem.runtime.kv.config import PRESETS, held_bytes
from tandem.runtime.moe.config import SPEED_NOTE, MoeOffloadSpec
from tandem.runtime.planning.hardware import format_size
from tandem.runtime.planning.memory_model import torch_capacity
from tandem.runtime.planning.plan import KV_QUALITY
from tandem.runtime.planning.shapes import padded_ctx, shape_from_gguf
from tandem.runtime.planning.torch_target import (
    LOW_BIT_SHARE,
    TORCH_BATCH,
    cache_budget,
    expert_bytes,
    torch_shape,
)


@dataclass(frozen=True)
class TechniqueOption:
    engine: str
    """``llama.cpp`` or ``torch``."""
    flag: str
    """How to ask for it, e.g. ``--kv-type q8_0`` or ``--engine torch --kv-compress kivi4``."""
    what: str
    """What it holds, e.g. ``KV cache at 4096 tokens``."""
    bytes: int
    quality: str
    chosen: bool = False

    def line(self) -> str:
        mark = "  <- plan" if self.chosen else ""
        return f"{self.flag:44} {format_size(self.bytes):>10}  {self.what}; {self.quality}{mark}"


def llama_kv_options(path: Path, n_ctx: int, chosen: str | None) -> list[TechniqueOption]:
    """The llama.cpp KV types this model's heads allow, at the plan's context."""
    shape = shape_from_gguf(path)
    cells = padded_ctx(n_ctx)
    return [TechniqueOption("llama.cpp", f"--kv-type {kv}", f"KV cache, {cells} cells",
                            shape.kv_bytes_per_token(kv, kv) * cells, KV_QUALITY[kv], kv == chosen)
            for kv in LLAMA_KV_TYPES if shape.kv_type_ok(kv)]


def torch_options(path: Path, n_ctx: int, chosen_kv: str | None = None) -> list[TechniqueOption]:
    """The torch engine's float32 weights, each ``--kv-compress`` setting at ``n_ctx``, and
    expert offload for a mixture-of-experts GGUF. ``chosen_kv``: the plan's setting
    (``none`` for the full cache) when the plan is the torch engine's."""
    shape = torch_shape(path)
    out = [TechniqueOption("torch", "--engine torch", "weights, float32 (dequantized)", shape.weights_bytes,
                           "the torch engine's float32 arithmetic may break a rare near-tie differently "
                           "from llama.cpp's quantized kernels")]
    full = shape.kv_bytes_per_token("f32", "f32") * torch_capacity(n_ctx)
    out.append(TechniqueOption("torch", "--engine torch --kv-compress none", f"KV cache, {n_ctx} tokens, float32",
                               full, "no quality cost", chosen_kv == "none"))
    for name, preset in PRESETS.items():
        held = held_bytes(preset.config, n_layer=shape.n_layer, n_head_kv=shape.n_head_kv,
                          head_dim=shape.head_dim, n_tokens=n_ctx, pass_tokens=min(TORCH_BATCH, n_ctx))
        out.append(TechniqueOption("torch", f"--engine torch --kv-compress {name}",
                                   f"KV cache, {n_ctx} tokens, {preset.summary}", held,
                                   preset.measured.describe(), name == chosen_kv))
    experts = expert_bytes(path)
    if experts:
        spec = MoeOffloadSpec()
        out.append(TechniqueOption("torch", f"--engine torch --moe-offload {spec.budget}",
                                   f"resident experts of {format_size(experts)}", cache_budget(spec.budget, experts),
                                   f"{spec.quality()}; {SPEED_NOTE}"))
        low = MoeOffloadSpec(low_bits=True)
        out.append(TechniqueOption("torch", f"--engine torch --moe-offload {low.budget} --moe-low-bits",
                                   "resident experts plus int4 copies", cache_budget(low.budget, experts)
                                   + int(experts * LOW_BIT_SHARE), low.quality()))
    return out
