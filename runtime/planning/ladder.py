"""The planner's ladder: every (target KV, target batch, drafter settings, draft length)
to try, from best to most frugal (the order is explained in :mod:`.planner`, which keeps
the first that fits), and the drafter's quantized copy worth a rung."""

from __future__ import annotations

from pathlib import Path

from tandem.errors import TandemError
from tandem.runtime.choices import LLAMA_KV_TYPES
from tandem.runtime.planning.plan import PlanRequest
from tandem.runtime.planning.shapes import ModelShape, shape_from_gguf

DRAFT_CELLS = (1024, 512, 256)
"""Context cells of a windowed drafter, from roomiest to leanest. llama.cpp pads a KV
cache to 256 cells (and the torch engine's cache doubles from 256), so memory moves in
those steps: each window is what its cells leave after the k + 1 draft and verify slots
(251 tokens at k = 4 in 256 cells: a 128 window there priced and measured the same
memory, but slid during SpecMemo's 192-token run and cost 5 % more target calls)."""
DRAFT_LENGTHS = (8, 4, 2)
LEAN_DRAFT_BATCH = 8
"""Prefill batch of the leanest drafter: a windowed drafter only ever re-reads its window,
and a small batch shrinks its compute buffer, output buffer and logits rows."""
DRAFT_QUANT = "q8_0"
"""Type of the drafter copy the ladder tries (lossless for the output: the target verifies)."""


def draft_rungs(d_shape: ModelShape, ctx: int, draft_max: int, quant: str | None):
    """Drafter settings ((window, batch, kv, quant), k, note) from best to leanest, each
    with the drafter's own weights first and then with its ``quant`` copy (if any)."""
    d_ctx_full = min(ctx, d_shape.n_ctx_train)
    d_kv = "q8_0" if d_shape.kv_type_ok("q8_0") else "f16"
    rungs = [((None, 256, "f16"), draft_max, "full drafter")]
    windows = [c - draft_max - 1 for c in DRAFT_CELLS]
    rungs += [((w, 64, "f16"), draft_max, f"draft window {w}") for w in windows if 0 < w < d_ctx_full]
    rungs += [((max(8, min(DRAFT_CELLS[-1] - k - 1, d_ctx_full)), LEAN_DRAFT_BATCH, d_kv), k, "lean drafter")
              for k in DRAFT_LENGTHS if k <= draft_max]
    for (window, batch, kv), k, note in rungs:
        for q in (None, quant) if quant else (None,):
            yield (window, batch, kv, q), k, note


def kv_candidates(t_shape: ModelShape, req: PlanRequest) -> list[str]:
    """The target KV types to try, best first: the one asked for, or f16 and then the
    quantized types the model's heads allow (unless ``allow_kv_quant`` is off)."""
    if req.kv_type is not None:
        if req.kv_type not in LLAMA_KV_TYPES:
            raise TandemError(f"Unknown KV cache type {req.kv_type!r}; choose one of {', '.join(LLAMA_KV_TYPES)}.")
        if not t_shape.kv_type_ok(req.kv_type):
            raise TandemError(f"--kv-type {req.kv_type} stores blocks of 32 values but {t_shape.name}'s attention "
                              f"heads have {t_shape.head_dim}; use f16 for this model.")
        return [req.kv_type]
    return [kv for kv in LLAMA_KV_TYPES if kv == "f16" or (req.allow_kv_quant and t_shape.kv_type_ok(kv))]


def ladder(t_shape: ModelShape, d_shape: ModelShape | None, ctx: int, draft_max: int, quant: str | None,
            kv_types: list[str]):
    """Candidate (target KV, target batch, drafter settings or None, k, note), best first."""
    for kv in kv_types:
        for t_batch in (256, 64):
            if d_shape is not None:
                for draft_cfg, k, note in draft_rungs(d_shape, ctx, draft_max, quant):
                    yield kv, t_batch, draft_cfg, k, note
            yield kv, t_batch, None, draft_max, "no draft model"


def draft_quant_copy(path: Path, shape: ModelShape) -> tuple[str, ModelShape] | None:
    """A :data:`DRAFT_QUANT` copy worth trying: for an F32/F16/BF16 drafter whose copy is
    at least 20 % smaller (its rows must hold whole blocks)."""
    if shape.weight_type not in ("f32", "f16", "bf16"):
        return None
    copy = shape_from_gguf(path, as_type=DRAFT_QUANT)
    return (DRAFT_QUANT, copy) if copy.weights_bytes <= 0.8 * shape.weights_bytes else None
