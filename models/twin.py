"""Cost twins: a Llama GGUF widened to a target size that computes the same function.

Benchmarks need targets with the cost of a 300M or 1B model but the behaviour of a
model whose drafter pairing we know (the tiny TinyStories models). A twin pads every
dimension with zeros, so it costs what a big model costs (the matmuls are dense, zeros
are multiplied like any number) yet produces the original's logits:

* hidden size d -> D: new residual channels start at zero (zero embedding columns) and
  stay zero, because every projection writing into the residual (attention output, FFN
  down) has zero rows there;
* RMSNorm over D channels sees the same sum of squares divided by D instead of d, so
  weights are scaled by sqrt(d/D) and eps becomes eps*d/D: x/sqrt(S/D + eps*d/D) *
  w*sqrt(d/D) = x/sqrt(S/d + eps) * w, exactly;
* attention heads: new heads keep the head dimension (RoPE unchanged) and the GQA ratio
  (query head h still reads KV head h // ratio), with all-zero weights, so they output
  zero and their output-projection columns are zero anyway;
* FFN n -> N: new gate/up rows are zero, silu(0) * 0 = 0, and down columns are zero;
* extra layers are appended with zero output projections (attention output and FFN
  down), so they add nothing to the residual: identity blocks.

Shape rule (:func:`plan_twin`): the width D is the multiple of 256 (so every K-quant
block is full and heads divide evenly) nearest to the width that gives the target with
a depth-to-width ratio of 1 layer per 64 channels; the FFN keeps the source's FFN/width
ratio (rounded up to 256); then the layer count is whatever brings the total closest to
the target. Vocabulary and head dimension are never changed.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from tandem.errors import TandemError, UnsupportedModel
from tandem.models import paths
from tandem.models.convert import PlannedTensor, write_streaming
from tandem.models.gguf_file import check_runnable, inspect_gguf
from tandem.models.quantize import QUANTIZED, check_type, quantize_gguf
from tandem.models.shape import DecoderShape, dims_from_gguf

WIDTH_QUANTUM = 256
CHANNELS_PER_LAYER = 64
_LAYER_TENSORS = (
    "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down",
)
_REPLACED_KEYS = ("embedding_length", "feed_forward_length", "block_count", "attention.head_count",
                  "attention.head_count_kv", "attention.layer_norm_rms_epsilon")


@dataclass(frozen=True)
class TwinReport:
    path: Path
    source: DecoderShape
    shape: DecoderShape
    seconds: float
    file_bytes: int


def parse_params(text: str | int) -> int:
    """``"300M"`` -> 300_000_000; accepts K, M, B/G suffixes and plain numbers."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMbBgG]?)\s*", text)
    if not m:
        raise TandemError(f"Cannot read parameter count {text!r}; write e.g. 300M or 1B.")
    scale = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def params_label(n: int) -> str:
    for unit, scale in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def _round_up(x: float, q: int) -> int:
    return int(math.ceil(x / q)) * q


def plan_twin(src: DecoderShape, target: int) -> DecoderShape:
    """The widened shape for ``target`` parameters (rule in the module docstring)."""
    ratio = src.n_head // src.n_head_kv
    quantum = math.lcm(WIDTH_QUANTUM, src.head_dim * ratio)
    ffn_ratio = src.n_ff / src.n_embd
    per_d2 = 2 + 2 / ratio + 3 * ffn_ratio  # layer params / D^2
    ideal = (CHANNELS_PER_LAYER * target / per_d2) ** (1 / 3)
    hidden = max(_round_up(src.n_embd, quantum), quantum * max(1, round(ideal / quantum)))
    heads = hidden // src.head_dim
    wide = replace(src, n_embd=hidden, n_ff=max(src.n_ff, _round_up(ffn_ratio * hidden, WIDTH_QUANTUM)),
                   n_head=heads, n_head_kv=heads // ratio, n_layer=1)
    per_layer = wide.layer_params
    layers = max(src.n_layer, round((target - replace(wide, n_layer=0).count_params()) / per_layer))
    shape = replace(wide, n_layer=layers)
    if target < src.count_params():
        raise TandemError(f"A twin must be larger than its source ({params_label(src.count_params())} parameters).")
    return shape


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    f = reader.fields.get(key)
    return f.contents() if f is not None else None


def read_shape(reader: gguf.GGUFReader) -> DecoderShape:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise UnsupportedModel(f"Cost twins are made from Llama GGUFs; this one is {arch!r}.")
    names = {t.name for t in reader.tensors}
    n_vocab = next(int(t.shape[1]) for t in reader.tensors if t.name == "token_embd.weight")
    shape = dims_from_gguf(lambda key, default: _field(reader, f"llama.{key}") or default, n_vocab,
                           tied="output.weight" not in names)
    known = {"token_embd.weight", "output_norm.weight", "output.weight"}
    known |= {f"blk.{i}.{n}.weight" for i in range(shape.n_layer) for n in _LAYER_TENSORS}
    if names - known:
        raise UnsupportedModel(f"Cannot widen tensors {sorted(names - known)[:4]} (plain Llama only).")
    return shape


def _as_f32(t: Any) -> np.ndarray:
    if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return np.asarray(t.data, dtype=np.float32)
    return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)


def _pad(w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    out = np.zeros(shape, dtype=np.float32)
    out[tuple(slice(0, n) for n in w.shape)] = w
    return out


def _target_shape(name: str, s: DecoderShape) -> tuple[int, ...]:
    """numpy (rows, cols) of a llama.cpp tensor for shape ``s``."""
    kind = name.split(".")[-2]
    q, kv = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    return {
        "token_embd": (s.n_vocab, s.n_embd), "output": (s.n_vocab, s.n_embd),
        "output_norm": (s.n_embd,), "attn_norm": (s.n_embd,), "ffn_norm": (s.n_embd,),
        "attn_q": (q, s.n_embd), "attn_k": (kv, s.n_embd), "attn_v": (kv, s.n_embd),
        "attn_output": (s.n_embd, q), "ffn_gate": (s.n_ff, s.n_embd), "ffn_up": (s.n_ff, s.n_embd),
        "ffn_down": (s.n_embd, s.n_ff),
    }[kind]


def _plan_tensors(reader: gguf.GGUFReader, src: DecoderShape, dst: DecoderShape, f16: bool) -> list[PlannedTensor]:
    by_name = {t.name: t for t in reader.tensors}
    norm_scale = math.sqrt(src.n_embd / dst.n_embd)

    def dtype(shape: tuple[int, ...]) -> type[np.floating[Any]]:
        return np.float16 if f16 and len(shape) > 1 else np.float32

    def widened(name: str) -> PlannedTensor:
        shape = _target_shape(name, dst)

        def make() -> np.ndarray:
            w = _as_f32(by_name[name])
            return _pad(w * norm_scale if w.ndim == 1 else w, shape)

        return PlannedTensor(name, shape, dtype(shape), make)

    def identity(name: str) -> PlannedTensor:
        shape = _target_shape(name, dst)
        fill = norm_scale if len(shape) == 1 else 0.0
        return PlannedTensor(name, shape, dtype(shape), lambda: np.full(shape, fill, dtype=np.float32))

    plan = [widened(n) for n in ("token_embd.weight", "output_norm.weight", "output.weight") if n in by_name]
    for i in range(dst.n_layer):
        make = widened if i < src.n_layer else identity
        plan += [make(f"blk.{i}.{n}.weight") for n in _LAYER_TENSORS]
    return plan


def _copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    skip = {"general.architecture", "general.file_type", "general.name"} | {f"llama.{k}" for k in _REPLACED_KEYS}
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in skip:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)


def _write_float_twin(src_path: Path, out: Path, target: int, f16: bool) -> tuple[DecoderShape, DecoderShape]:
    reader = gguf.GGUFReader(src_path)
    src = read_shape(reader)
    dst = plan_twin(src, target)
    eps = float(_field(reader, "llama.attention.layer_norm_rms_epsilon") or 1e-5)
    writer = gguf.GGUFWriter(out, "llama")
    _copy_metadata(reader, writer)
    writer.add_name(f"{_field(reader, 'general.name') or src_path.stem} twin {params_label(dst.count_params())}")
    writer.add_file_type(1 if f16 else 0)
    writer.add_embedding_length(dst.n_embd)
    writer.add_feed_forward_length(dst.n_ff)
    writer.add_block_count(dst.n_layer)
    writer.add_head_count(dst.n_head)
    writer.add_head_count_kv(dst.n_head_kv)
    writer.add_layer_norm_rms_eps(eps * src.n_embd / dst.n_embd)
    write_streaming(writer, _plan_tensors(reader, src, dst, f16))
    return src, dst


def build_twin(
    src: str | os.PathLike[str], out: str | os.PathLike[str], params: int | str, qtype: str = "f32"
) -> TwinReport:
    """Write the cost twin of the Llama GGUF ``src`` with about ``params`` parameters to ``out``."""
    src, out = Path(src), Path(out)
    qtype = check_type(qtype)
    check_runnable(inspect_gguf(src))
    target = parse_params(params)
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".twin-") as tmp:
        staged = Path(tmp) / "twin.gguf"
        if qtype in QUANTIZED:
            f32 = Path(tmp) / "f32.gguf"
            src_shape, shape = _write_float_twin(src, f32, target, f16=False)
            quantize_gguf(f32, staged, qtype)
        else:
            src_shape, shape = _write_float_twin(src, staged, target, f16=qtype == "f16")
        os.replace(staged, out)
    return TwinReport(out, src_shape, shape, time.perf_counter() - start, out.stat().st_size)


def twin_name(src: str | os.PathLike[str], params: int | str, qtype: str) -> str:
    return f"{Path(src).stem}-twin-{params_label(parse_params(params))}-{check_type(qtype)}.gguf"


def ensure_twin(
    src_gguf: str | os.PathLike[str], params: int | str, qtype: str = "q8_0",
    cache_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """The cached twin of ``src_gguf`` (built on first use; reused by name afterwards).

    ``cache_dir`` defaults to ``<tandem cache>/twins``; benchmarks pass the repository's
    git-ignored ``.bench/twins``. Files appear atomically (built under a temporary name),
    so a path returned here is always a complete GGUF.
    """
    folder = Path(cache_dir) if cache_dir is not None else paths.cache_dir() / "twins"
    path = folder / twin_name(src_gguf, params, qtype)
    if path.is_file():
        return path
    return build_twin(src_gguf, path, params, qtype).path
