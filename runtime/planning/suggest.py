"""What would fit when nothing does: KV quantization, the largest context, a smaller
quant, the smallest budget.

Split out of :mod:`tandem.runtime.planning.planner` (which calls :func:`suggest` for a refused
plan). Every suggestion is priced with the same memory model as the plan itself, on
the leanest rung of its ladder (no draft model, model-free drafts of ``draft_max``,
prefill batch 64), so a suggestion that is followed really fits. They answer different
questions and never contradict each other: the largest context is the largest that
fits *this* budget; the budget is the smallest that fits *the context asked for*
(which is larger than that largest context, or the plan would have fit).
"""

from __future__ import annotations

import math
from dataclasses import replace

from tandem.runtime.planning.hardware import format_size
from tandem.runtime.planning.memory_model import Setup, estimate
from tandem.runtime.planning.shapes import ModelShape

QUANT_BPW = {"q8_0": 8.5, "q6_k": 6.56, "q5_k_m": 5.69, "q4_k_m": 4.85, "q4_0": 4.5, "q3_k_m": 3.91}
"""Average bits per weight of common GGUF quantizations (llama.cpp's published sizes)."""
LEAN_BATCH = 64
"""The leanest rung's target prefill batch (as the planner's ladder)."""
MIN_SUGGESTED_CTX = 64


def size_up(n: float) -> str:
    """``n`` bytes in binary units rounded *up* to the tenth printed, so a budget
    suggested this way is never a hair short of what it must hold."""

    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2)):
        if n >= size:
            return f"{math.ceil(n / size * 10) / 10:.1f} {unit}"
    return f"{math.ceil(n / 1024)} KiB"


def leanest_kv(shape: ModelShape, allow_quant: bool) -> str:
    return "q8_0" if allow_quant and shape.kv_type_ok("q8_0") else "f16"


def lean_need(shape: ModelShape, ctx: int, kv: str, k: int) -> int:
    """Host bytes of the leanest rung at context ``ctx`` (no draft model, model-free
    drafts of ``k``, prefill batch :data:`LEAN_BATCH`), without the process baseline."""
    return estimate(shape, Setup(ctx + k, LEAN_BATCH, kv, kv, output_rows=k + 1), k=k).host


def largest_context(room: float, shape: ModelShape, upper: int, kv: str, k: int) -> int:
    """The largest context up to ``upper`` whose leanest rung fits in ``room`` bytes (0: none)."""
    lo, hi = 0, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if lean_need(shape, mid, kv, k) <= room:
            lo = mid
        else:
            hi = mid - 1
    return lo


def suggest(room: float, baseline: int, safety: float, t_shape: ModelShape, ctx: int, draft_max: int,
            allow_kv_quant: bool) -> list[str]:
    """Suggestions for a target that does not fit in ``room`` bytes of host memory (the
    budget less the safety share and the ``baseline`` already resident) at ``ctx``."""
    out: list[str] = []
    k = draft_max
    for kv in ("q8_0", "q4_0"):
        if not t_shape.kv_type_ok(kv) or (kv != "f16" and not allow_kv_quant):
            continue
        if lean_need(t_shape, ctx, kv, k) <= room:
            out.append(f"--kv-type {kv} at context {ctx}" + (" (q4_0 KV costs quality)" if kv == "q4_0" else ""))
            break
    kv = leanest_kv(t_shape, allow_kv_quant)
    largest = largest_context(room, t_shape, ctx - 1, kv, k)
    if largest >= MIN_SUGGESTED_CTX:
        out.append(f"--ctx {largest} or less" + (f" (with {kv} KV)" if kv != "f16" else ""))
    for q, bpw in sorted(QUANT_BPW.items(), key=lambda kv: -kv[1]):
        scale = bpw / 8 / (t_shape.weights_bytes / max(t_shape.n_params, 1))
        if scale >= 0.9:
            continue
        smaller = replace(t_shape, layer_bytes=tuple(int(b * scale) for b in t_shape.layer_bytes),
                          input_bytes=int(t_shape.input_bytes * scale), output_bytes=int(t_shape.output_bytes * scale),
                          file_bytes=int(t_shape.file_bytes * scale))
        if lean_need(smaller, ctx, "f16", k) <= room:
            out.append(f"a {q.upper()} quant of the model (~{format_size(smaller.weights_bytes)} of weights)")
            break
    need = (baseline + lean_need(t_shape, ctx, kv, k)) / (1 - safety)
    out.append(f"--budget {size_up(need)} or more for context {ctx} ({kv} KV, without a draft model)")
    return out
