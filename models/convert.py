"""Hugging Face Llama checkpoint (safetensors + config.json + tokenizer.json) -> GGUF.

Tensors get llama.cpp's names and layout, as llama.cpp's ``convert_hf_to_gguf.py``
writes them: HF stores q/k projections with the two RoPE halves of each head split
("rotate_half" convention) while llama.cpp rotates adjacent pairs, so the rows of every
head of ``q_proj``/``k_proj`` are interleaved back (:func:`permute_qk`). Tied embeddings
are written once as ``token_embd`` (llama.cpp reuses it as the output matrix), taken
from ``lm_head.weight`` when that is the only copy stored.

Tensors are written streaming (:func:`write_streaming`): one tensor is materialised at
a time, so converting a multi-GB checkpoint does not hold it twice in memory. Q8_0 and
Q4_K_M go through an F32 GGUF and llama.cpp's own quantizer.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from tandem.errors import ModelFormatError, ModelNotFound, UnsupportedModel
from tandem.models.hf_tokenizer import add_vocab, read_hf_tokenizer
from tandem.models.quantize import QUANTIZED, check_type, quantize_gguf
from tandem.models.shape import DecoderShape, dims_from_hf

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)


@dataclass(frozen=True, kw_only=True)
class LlamaHParams(DecoderShape):
    """The hyperparameters llama.cpp needs: the dimensions (:class:`DecoderShape`) plus
    the norm epsilon and RoPE settings."""

    rms_eps: float
    rope_theta: float
    rope_linear_factor: float | None = None


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor to write: its GGUF name, numpy shape and dtype, and how to make it."""

    name: str
    shape: tuple[int, ...]
    dtype: type[np.floating[Any]]
    make: Callable[[], np.ndarray]


def write_streaming(writer: gguf.GGUFWriter, tensors: Iterable[PlannedTensor],
                    progress: Callable[[int, int], None] | None = None) -> None:
    """Write all planned tensors, materialising one at a time (header first, then data);
    ``progress(done, total)`` is called after each tensor."""
    tensors = list(tensors)
    for t in tensors:
        nbytes = int(np.prod(t.shape)) * np.dtype(t.dtype).itemsize
        writer.add_tensor_info(t.name, t.shape, np.dtype(t.dtype), nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for done, t in enumerate(tensors, 1):
        data = np.ascontiguousarray(t.make(), dtype=t.dtype)
        if data.shape != t.shape:
            raise ModelFormatError(f"tensor {t.name}: made shape {data.shape}, planned {t.shape}")
        writer.write_tensor_data(data)
        if progress is not None:
            progress(done, len(tensors))
    writer.close()


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half row order -> llama.cpp interleaved pairs, per head (as convert_hf_to_gguf)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _read_config(src: Path) -> dict[str, Any]:
    if not src.exists():
        raise ModelNotFound(f"No such checkpoint folder: {src}")
    if not src.is_dir():
        raise ModelFormatError(f"{src} is not a folder; `tandem convert` takes a Hugging Face checkpoint folder.")
    path = src / "config.json"
    if not path.is_file():
        raise ModelFormatError(f"{src} has no config.json: not a Hugging Face checkpoint folder.")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelFormatError(f"{path} is not valid JSON: {exc}") from None


def read_hparams(config: dict[str, Any]) -> LlamaHParams:
    """Validate config.json and extract the Llama hyperparameters."""
    archs = config.get("architectures") or [config.get("model_type", "?")]
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise UnsupportedModel(
            f"architecture {', '.join(map(str, archs))} is not supported by `tandem convert` "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})."
        )
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise UnsupportedModel(f"Llama checkpoints with {key}=true are not supported.")
    factor = None
    scaling = config.get("rope_scaling")
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "linear":
            raise UnsupportedModel(f"rope_scaling type {kind!r} is not supported (only linear).")
        factor = float(scaling["factor"])
    try:
        dims = dims_from_hf(config)
        if "intermediate_size" not in config:  # a llama.cpp Llama has a dense FFN of this width
            raise KeyError("intermediate_size")
        return LlamaHParams(
            **dims.dims(),
            rms_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(config.get("rope_theta", 10000.0)),
            rope_linear_factor=factor,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelFormatError(f"config.json lacks a valid Llama hyperparameter: {exc}") from None


class _SafetensorsIndex:
    """Every tensor of a (possibly sharded) safetensors checkpoint, loaded on demand."""

    def __init__(self, src: Path) -> None:
        # local: the [torch] extra (`tandem convert` checks it is there first)
        from safetensors import safe_open

        files = sorted(src.glob("*.safetensors"))
        if not files:
            raise ModelFormatError(f"{src} has no *.safetensors weights (PyTorch .bin checkpoints are not supported).")
        self._handles = []
        self.where: dict[str, Any] = {}
        for f in files:
            try:
                handle = safe_open(str(f), framework="pt")
            except Exception as exc:  # safetensors raises its own SafetensorError
                raise ModelFormatError(f"{f} is not a valid safetensors file: {exc}") from None
            self._handles.append(handle)
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                self.where[key] = handle

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.where[name].get_slice(name).get_shape())

    def load(self, name: str) -> np.ndarray:
        import torch  # local: the [torch] extra, seconds to import

        return self.where[name].get_tensor(name).to(torch.float32).numpy()


def _tensor_plan(hp: LlamaHParams, st: _SafetensorsIndex, f16: bool) -> list[PlannedTensor]:
    def dtype_for(shape: tuple[int, ...]) -> type[np.floating[Any]]:
        return np.float16 if f16 and len(shape) > 1 else np.float32

    def planned(gguf_name: str, hf_name: str, transform: Callable[[np.ndarray], np.ndarray] | None = None):
        if hf_name not in st.where:
            raise ModelFormatError(f"checkpoint lacks tensor {hf_name!r}")
        shape = st.shape(hf_name)

        def make() -> np.ndarray:
            w = st.load(hf_name)
            return transform(w) if transform else w

        return PlannedTensor(gguf_name, shape, dtype_for(shape), make)

    embed = "model.embed_tokens.weight" if "model.embed_tokens.weight" in st.where else "lm_head.weight"
    plan = [planned("token_embd.weight", embed)]
    for i in range(hp.n_layer):
        p = f"model.layers.{i}."
        plan += [
            planned(f"blk.{i}.attn_norm.weight", p + "input_layernorm.weight"),
            planned(f"blk.{i}.attn_q.weight", p + "self_attn.q_proj.weight", lambda w: permute_qk(w, hp.n_head)),
            planned(f"blk.{i}.attn_k.weight", p + "self_attn.k_proj.weight", lambda w: permute_qk(w, hp.n_head_kv)),
            planned(f"blk.{i}.attn_v.weight", p + "self_attn.v_proj.weight"),
            planned(f"blk.{i}.attn_output.weight", p + "self_attn.o_proj.weight"),
            planned(f"blk.{i}.ffn_norm.weight", p + "post_attention_layernorm.weight"),
            planned(f"blk.{i}.ffn_gate.weight", p + "mlp.gate_proj.weight"),
            planned(f"blk.{i}.ffn_up.weight", p + "mlp.up_proj.weight"),
            planned(f"blk.{i}.ffn_down.weight", p + "mlp.down_proj.weight"),
        ]
    plan.append(planned("output_norm.weight", "model.norm.weight"))
    if not hp.tied and embed != "lm_head.weight" and "lm_head.weight" in st.where:
        plan.append(planned("output.weight", "lm_head.weight"))
    return plan


def add_llama_hparams(writer: gguf.GGUFWriter, hp: LlamaHParams) -> None:
    writer.add_context_length(hp.n_ctx_train)
    writer.add_embedding_length(hp.n_embd)
    writer.add_block_count(hp.n_layer)
    writer.add_feed_forward_length(hp.n_ff)
    writer.add_head_count(hp.n_head)
    writer.add_head_count_kv(hp.n_head_kv)
    writer.add_rope_dimension_count(hp.head_dim)
    if hp.head_dim * hp.n_head != hp.n_embd:
        writer.add_key_length(hp.head_dim)
        writer.add_value_length(hp.head_dim)
    writer.add_layer_norm_rms_eps(hp.rms_eps)
    writer.add_rope_freq_base(hp.rope_theta)
    if hp.rope_linear_factor:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(hp.rope_linear_factor)
    writer.add_vocab_size(hp.n_vocab)


def _write_float(src: Path, out: Path, f16: bool, progress: Callable[[int, int], None] | None = None) -> None:
    config = _read_config(src)
    hp = read_hparams(config)
    st = _SafetensorsIndex(src)
    vocab = read_hf_tokenizer(src, config)
    if len(vocab.tokens) != hp.n_vocab:
        raise ModelFormatError(
            f"tokenizer has {len(vocab.tokens)} tokens but config.json says vocab_size={hp.n_vocab}."
        )
    plan = _tensor_plan(hp, st, f16)
    writer = gguf.GGUFWriter(out, "llama")
    writer.add_name(src.name)
    writer.add_file_type(1 if f16 else 0)
    add_llama_hparams(writer, hp)
    add_vocab(writer, vocab)
    write_streaming(writer, plan, progress)


def convert_hf(src: str | os.PathLike[str], out: str | os.PathLike[str], qtype: str = "f32",
               progress: Callable[[int, int], None] | None = None) -> Path:
    """Convert the checkpoint folder ``src`` to the GGUF file ``out`` of type ``qtype``;
    ``progress(done, total)`` follows the tensors written.

    The file is written under a temporary name and renamed when complete, so an
    interrupted conversion never leaves a truncated GGUF behind.
    """
    src, out = Path(src), Path(out)
    qtype = check_type(qtype)
    _read_config(src)  # fail early on a bad folder, before creating anything
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".convert-") as tmp:
        staged = Path(tmp) / "model.gguf"
        if qtype in QUANTIZED:
            f32 = Path(tmp) / "f32.gguf"
            _write_float(src, f32, f16=False, progress=progress)
            quantize_gguf(f32, staged, qtype)
        else:
            _write_float(src, staged, f16=qtype == "f16", progress=progress)
        os.replace(staged, out)
    return out


def ensure_converted(
    src: str | os.PathLike[str], cache_dir: str | os.PathLike[str], qtype: str = "f32"
) -> Path:
    """The GGUF of checkpoint folder ``src`` in ``cache_dir``, converted on first use."""
    path = Path(cache_dir) / f"{Path(src).name}-{check_type(qtype)}.gguf"
    return path if path.is_file() else convert_hf(src, path, qtype)
