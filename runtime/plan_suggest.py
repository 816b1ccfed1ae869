"""What would fit when nothing does: the largest context, KV quantization, a smaller quant.

Split out of :mod:`tandem.runtime.planner` (which calls :func:`suggest` for a refused
plan); every suggestion is priced with the same memory model as the plan itself, on its
leanest rung (no draft model, model-free drafts of ``draft_max``), so a suggestion that
is followed really fits.
"""

from __future__ import annotations

from dataclasses import replace

from tandem.runtime.hardware import format_size
from tandem.runtime.memory_model import ModelShape, Setup, estimate

QUANT_BPW = {"q8_0": 8.5, "q6_k": 6.56, "q5_k_m": 5.69, "q4_k_m": 4.85, "q4_0": 4.5, "q3_k_m": 3.91}
"""Average bits per weight of common GGUF quantizations (llama.cpp's published sizes)."""


def leanest_kv(shape: ModelShape, allow_quant: bool) -> str:
    return "q8_0" if allow_quant and shape.kv_type_ok("q8_0") else "f16"


def suggest(room: float, baseline: int, safety: float, t_shape: ModelShape, ctx: int, draft_max: int,
            allow_kv_quant: bool) -> list[str]:
    """Suggestions for a target that does not fit in ``room`` bytes of host memory (the
    budget less the safety share and the ``baseline`` already resident)."""
    out: list[str] = []
    k = draft_max

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
        if target_only(mid, leanest_kv(t_shape, allow_kv_quant)) <= room:
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
    need = (baseline + target_only(ctx, "f16")) / (1 - safety)
    out.append(f"--budget {format_size(need)} for context {ctx} without a draft model")
    return out
