"""Model shapes for the memory model: what it needs to know about a model (its
:class:`~tandem.models.shape.DecoderShape` dimensions and weight bytes), read from a
GGUF header or a Hugging Face config without loading any weights."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from tandem.errors import TandemError
from tandem.models.shape import KV_TYPE_SIZES, DecoderShape, dims_from_hf
from tandem.runtime.backends.host_experts import EXPERT_TENSOR

KV_PAD = 256
"""llama.cpp rounds the KV cache's cell count up to this many (padding for kernels)."""


def padded_ctx(n_ctx: int, kind: str = "llama.cpp") -> int:
    """KV cells a context of ``n_ctx`` takes: llama.cpp pads to :data:`KV_PAD`."""
    return math.ceil(n_ctx / KV_PAD) * KV_PAD if kind == "llama.cpp" else n_ctx


@dataclass(frozen=True, kw_only=True)
class ModelShape(DecoderShape):
    """What the memory model needs to know about one model: its dimensions
    (:class:`DecoderShape`) and the bytes of its weights."""

    name: str
    layer_bytes: tuple[int, ...]
    """Weight bytes of each block, in order."""
    input_bytes: int
    """Token embedding (always on the host in llama.cpp)."""
    output_bytes: int
    """Final norm and output head (offloaded only when every layer is)."""
    weight_type: str = "f32"
    n_params: int = 0
    path: str | None = None
    """The GGUF file llama.cpp would load, for asking llama.cpp its own buffer sizes
    (:mod:`tandem.runtime.planning.llama_sizes`); a quantized copy names its source, whose
    graph (and so compute buffer) is the same. ``None``: not a GGUF (torch, ONNX)."""
    file_bytes: int = 0
    """Bytes of the file llama.cpp maps (the whole file is resident while it loads:
    header and tensor data); 0: not a GGUF."""
    expert_bytes: tuple[int, ...] = ()
    """Bytes of each block's routed experts (``blk.N.ffn_{gate,up,down}_exps``), in
    order, included in :attr:`layer_bytes`; empty for a dense model. What keeping the
    experts of a block in host memory takes off the GPU."""

    @property
    def expert_layers(self) -> tuple[int, ...]:
        """The blocks that hold experts, in order (the ones ``host_expert_layers`` counts)."""
        return tuple(i for i, b in enumerate(self.expert_bytes) if b)

    def host_expert_bytes(self, n: int) -> int:
        """Expert bytes of the first ``n`` expert blocks (``-1``: all)."""
        layers = self.expert_layers if n < 0 else self.expert_layers[:n]
        return sum(self.expert_bytes[i] for i in layers)

    @property
    def weights_bytes(self) -> int:
        return sum(self.layer_bytes) + self.input_bytes + self.output_bytes


_BLOCK = re.compile(r"^blk\.(\d+)\.")


QUANT_COPY_TYPES = ("q8_0", "f16")
"""Types :func:`shape_from_gguf` can price a llama.cpp-quantized copy in (whole-file
types with one rule per tensor; the mixed K-quant presets choose per tensor)."""


def _copy_nbytes(name: str, shape: tuple[int, ...], nbytes: int, as_type: str) -> int:
    """Bytes of one tensor after ``llama_model_quantize`` to ``as_type``: 2-D+ weights
    take the type when their rows hold whole blocks and fall back to f16 otherwise
    (checked against llama.cpp on stories260K, whose 172-wide ffn_down stays f16);
    1-D tensors (norms, biases) keep their type."""
    if len(shape) < 2 or not name.endswith("weight"):
        return nbytes
    block, size = KV_TYPE_SIZES[as_type if shape[0] % KV_TYPE_SIZES[as_type][0] == 0 else "f16"]
    return math.prod(shape) // block * size


def shape_from_gguf(path_or_info, as_type: str | None = None) -> ModelShape:
    """A :class:`ModelShape` from a GGUF header (no tensor data is read); with
    ``as_type`` (one of :data:`QUANT_COPY_TYPES`), the shape of the copy llama.cpp's
    quantizer would make, so the planner can price a quantized drafter before making it."""
    # local: loads the gguf package only when this runs
    from tandem.models.gguf_file import GGUFInfo, check_runnable, inspect_gguf

    info: GGUFInfo = path_or_info if isinstance(path_or_info, GGUFInfo) else inspect_gguf(path_or_info)
    check_runnable(info)  # an unknown architecture or metadata that would make llama.cpp's size probe abort
    if as_type is not None and as_type not in QUANT_COPY_TYPES:
        raise TandemError(f"Cannot price a {as_type} copy; choose one of {', '.join(QUANT_COPY_TYPES)}.")
    dims = info.shape()
    n_layer = dims.n_layer
    layers = [0] * n_layer
    experts = [0] * n_layer
    inp = out = 0
    types: dict[int, int] = {}
    for t in info.tensors:
        nbytes = t.nbytes if as_type is None else _copy_nbytes(t.name, tuple(t.shape), t.nbytes, as_type)
        m = _BLOCK.match(t.name)
        if m and int(m.group(1)) < n_layer:
            layers[int(m.group(1))] += nbytes
            if EXPERT_TENSOR.match(t.name):
                experts[int(m.group(1))] += nbytes
            types[t.ggml_type] = types.get(t.ggml_type, 0) + nbytes
        elif t.name.startswith("token_embd"):
            inp += nbytes
        else:
            out += nbytes
    import gguf  # local: gguf's reader only when a file is read here

    wtype = gguf.GGMLQuantizationType(max(types, key=types.get)).name.lower() if types else "f32"
    return ModelShape(
        **dims.dims(), name=info.path.stem if as_type is None else f"{info.path.stem} ({as_type.upper()} copy)",
        layer_bytes=tuple(layers), input_bytes=inp, output_bytes=out, weight_type=as_type or wtype,
        n_params=info.n_params, path=str(info.path),
        file_bytes=info.file_size - info.weights_bytes + inp + out + sum(layers),
        expert_bytes=tuple(experts) if any(experts) else (),
    )


def shape_from_hf(folder: str | Path, dtype_bytes: int = 4) -> ModelShape:
    """A :class:`ModelShape` from a Hugging Face Llama folder (config.json), weights in
    ``dtype_bytes`` per parameter (the torch engine's dtype, not the file's)."""
    cfg_path = Path(folder) / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as exc:
        raise TandemError(f"Cannot read {cfg_path}: {exc}") from None
    try:
        dims = dims_from_hf(cfg)
    except (KeyError, TypeError, ValueError) as exc:
        raise TandemError(f"{cfg_path} lacks a valid Llama dimension: {exc}") from None
    e, v, tied = dims.n_embd, dims.n_vocab, dims.tied
    per_layer = dims.layer_params
    return ModelShape(
        **dims.dims(), name=Path(folder).name,
        layer_bytes=(per_layer * dtype_bytes,) * dims.n_layer, input_bytes=v * e * dtype_bytes,
        output_bytes=(e + (0 if tied else v * e)) * dtype_bytes, weight_type=f"{8 * dtype_bytes}-bit float",
        n_params=dims.count_params(),
    )
