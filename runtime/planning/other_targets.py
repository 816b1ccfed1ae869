"""Budget check for targets the planner does not plan: ONNX exports and Hugging Face folders.

The planner (:mod:`tandem.runtime.planning.planner`) sizes llama.cpp models; an ONNX export
(onnxruntime) or a Hugging Face folder (the torch engine on the CPU) has no knobs it
could turn, but the memory model prices both kinds. :func:`plan_unplanned` prices the
target at the context it would open with and refuses, before anything is loaded, when
the predicted host memory plus the process baseline exceeds the budget, so ``tandem run``
and ``tandem chat`` never start a model that cannot fit. The refusal names
the largest context that would fit, since the context is the one thing the user can
change for such a target.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from tandem.errors import BudgetError, TandemError
from tandem.runtime.backends.onnx_meta import META_FILE, read_onnx_meta
from tandem.runtime.planning.devices import SAFETY
from tandem.runtime.planning.hardware import format_size, resolve_machine
from tandem.runtime.planning.memory_model import Setup, estimate
from tandem.runtime.planning.memprobe import process_rss, unresident_code
from tandem.runtime.planning.shapes import ModelShape, shape_from_gguf, shape_from_hf

MEMORY_KINDS = {"onnx": "onnxruntime", "torch": "torch"}
"""``open_backend.backend_kind`` -> the memory model's backend kind."""
DEFAULT_BATCH = 512
"""Both backends chunk a prompt by 512 tokens unless told otherwise (their configs)."""
MIN_CTX = 256


@dataclass(frozen=True)
class UnplannedCheck:
    """What the check found: the memory kind, the context priced and the host figures."""

    kind: str
    n_ctx: int
    predicted: int
    baseline: int
    budget: int

    @property
    def host_total(self) -> int:
        return self.baseline + self.predicted


def _folder(path: Path) -> Path:
    return path.parent if path.is_file() else path


def onnx_shape(path: str | Path) -> ModelShape:
    """The shape of an ONNX export, weights as float32 (the exported graph's type).

    ``tandem export-onnx`` copies ``config.json`` from a Hugging Face source; from a GGUF
    source it writes ``tandem-onnx.json`` naming the source file, whose header gives the
    shape (its weights are rescaled to float32). Failing both, the metadata alone gives a
    lower bound (query heads taken as the KV heads)."""
    folder = _folder(Path(path))
    if (folder / "config.json").exists():
        return shape_from_hf(folder)
    meta = read_onnx_meta(folder)
    if meta is None:
        raise TandemError(f"Cannot tell the shape of the ONNX export {folder}: no readable {META_FILE}.")
    source = Path(meta.source)
    if meta.source and source.is_file():
        shape = shape_from_gguf(source)
        if shape.n_params and shape.weights_bytes < 4 * shape.n_params:
            scale = 4 * shape.n_params / shape.weights_bytes
            shape = replace(shape, layer_bytes=tuple(int(b * scale) for b in shape.layer_bytes),
                            input_bytes=int(shape.input_bytes * scale), output_bytes=int(shape.output_bytes * scale),
                            weight_type="f32")
        return shape
    weights = sum(f.stat().st_size for f in folder.iterdir() if f.is_file() and not f.name.endswith(".int8.onnx")
                  and f.suffix not in (".json", ".gguf"))
    hkv, hd, layers = meta.n_head_kv, meta.head_dim, meta.n_layer
    return ModelShape(name=folder.name, n_layer=layers, n_embd=hkv * hd, n_head=hkv, n_head_kv=hkv,
                      head_dim=hd, head_dim_v=hd, n_ff=0, n_vocab=meta.n_vocab,
                      n_ctx_train=meta.n_ctx_train, layer_bytes=(weights // max(layers, 1),) * layers,
                      input_bytes=0, output_bytes=0)


def _import_runtime(kind: str) -> None:
    """Import the backend first, so its libraries (``import torch``: hundreds of MB) are
    in the baseline, where the memory model expects them, not missed by the check."""
    if kind == "torch":
        import tandem.runtime.backends.torch_engine.backend  # noqa: F401
    else:
        import onnxruntime  # noqa: F401


def plan_unplanned(path: str | Path, kind: str, budget: int | str | None = None, ctx: int | None = None, *,
                   n_batch: int = DEFAULT_BATCH, output_rows: int = 1, baseline: int | None = None) -> UnplannedCheck:
    """Price an ONNX export (``kind="onnx"``) or a Hugging Face folder (``"torch"``) at
    ``ctx`` (default: the model's, at most 4096, as the backends open it) and raise
    :class:`BudgetError` when it would not fit ``budget`` (default: the planner's share of
    available RAM), with the largest context that would. ``baseline``: the process's
    resident bytes before loading (default: measured now, after importing the backend)."""
    if kind not in MEMORY_KINDS:
        raise TandemError(f"plan_unplanned prices ONNX exports and Hugging Face folders, not {kind!r}.")
    mem_kind = MEMORY_KINDS[kind]
    path = Path(path)
    shape = onnx_shape(path) if kind == "onnx" else shape_from_hf(path)
    machine = resolve_machine(None, budget, None, measure_bandwidth=False)
    if baseline is None:
        _import_runtime(kind)
        baseline = process_rss() + unresident_code()
    if ctx is not None and ctx > shape.n_ctx_train:
        raise TandemError(f"--ctx {ctx} is longer than {shape.name} was trained for ({shape.n_ctx_train} tokens); "
                          f"use --ctx {shape.n_ctx_train} or less.")
    n_ctx = ctx or min(shape.n_ctx_train, 4096)
    room = machine.host_budget * (1 - SAFETY) - baseline

    def predicted(cells: int) -> int:
        setup = Setup(cells, n_batch, type_k="f32", type_v="f32", output_rows=output_rows)
        return estimate(shape, setup, kind=mem_kind).host

    need = predicted(n_ctx)
    check = UnplannedCheck(mem_kind, n_ctx, need, baseline, machine.host_budget)
    if need <= room:
        return check
    cells = n_ctx // 2
    while cells >= MIN_CTX and predicted(cells) > room:
        cells //= 2
    hint = (f"--ctx {cells}" if cells >= MIN_CTX else
            f"a budget of at least {format_size((baseline + predicted(MIN_CTX)) / (1 - SAFETY))} (--ctx {MIN_CTX})")
    raise BudgetError(
        f"{shape.name} ({mem_kind}) at context {n_ctx} needs {format_size(need + baseline)} of host memory "
        f"(model {format_size(need)} + process {format_size(baseline)}), over the budget of "
        f"{format_size(machine.host_budget)}. What would fit: {hint}.")
