"""Weights for the torch engine from GGUF (any ggml type, dequantized) or HF safetensors.

Both loaders return a :class:`ModelConfig` and a dict of tensors under GGUF names (see
:mod:`.config`). Two format differences are handled here, once:

* **RoPE layout.** llama.cpp's converter permutes Llama Q/K rows so pairs ``(2i, 2i+1)``
  rotate together (the original Meta layout, ``LLAMA_ROPE_TYPE_NORM``); Hugging Face
  rotates ``(i, i + d/2)``. The engine implements the latter, so GGUF Llama Q/K weights
  (and biases) are un-permuted on load. NEOX-rope architectures (Qwen2) need nothing.
* **Tied embeddings.** A missing output head means the embedding matrix is reused; a
  checkpoint that stores only ``lm_head.weight`` (TinyStories-656K) gives the embedding.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from tandem.errors import ModelFormatError, ModelNotFound, UnsupportedModel
from tandem.models.shape import dims_from_gguf, dims_from_hf
from tandem.runtime.backends.torch_engine.config import ModelConfig

INTERLEAVED_ROPE_ARCHS = {"llama"}
"""GGUF architectures whose Q/K rows llama.cpp stores interleaved (rope type NORM)."""
NEOX_ROPE_ARCHS = {"qwen2", "qwen2moe"}
SUPPORTED_GGUF_ARCHS = INTERLEAVED_ROPE_ARCHS | NEOX_ROPE_ARCHS


def unpermute_rope(w: np.ndarray, n_head: int, rotary_dim: int) -> np.ndarray:
    """Interleaved (2i, 2i+1) RoPE rows -> half-split (i, i + r/2) rows, per head.

    Inverse of ``convert_hf_to_gguf.LlamaModel.permute``; rows past ``rotary_dim`` in a
    head are not rotated and stay where they are. Works for weights and biases.
    """
    rows = w.shape[0]
    head_dim = rows // n_head
    heads = w.reshape(n_head, head_dim, *w.shape[1:]).copy()
    rot = heads[:, :rotary_dim].reshape(n_head, rotary_dim // 2, 2, *w.shape[1:])
    heads[:, :rotary_dim] = rot.swapaxes(1, 2).reshape(n_head, rotary_dim, *w.shape[1:])
    return heads.reshape(w.shape)


def _to_torch(a: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    a = np.ascontiguousarray(a)
    if not a.flags.writeable:  # a view of the read-only mmap: torch wants its own copy
        a = a.copy()
    return torch.from_numpy(a).to(device=device, dtype=dtype)


# -- GGUF ----------------------------------------------------------------------------
def _gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return default if value is None else value


def gguf_config(reader, shapes: dict[str, tuple[int, ...]]) -> ModelConfig:
    arch = str(_gguf_field(reader, "general.architecture", ""))
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise UnsupportedModel(
            f"The torch engine runs Llama-family GGUF models ({', '.join(sorted(SUPPORTED_GGUF_ARCHS))}); "
            f"this file's architecture is {arch!r}."
        )

    def meta(name: str, default=None):
        return _gguf_field(reader, f"{arch}.{name}", default)

    dims = dims_from_gguf(meta, shapes["token_embd.weight"][0], "output.weight" not in shapes)
    return ModelConfig(
        **dims.dims(),
        arch=arch,
        norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_dim=int(meta("rope.dimension_count", dims.head_dim)),
        n_experts=int(meta("expert_count", 0) or 0),
        n_experts_used=int(meta("expert_used_count", 0) or 0),
        n_ff_exp=int(meta("expert_feed_forward_length", dims.n_ff) or dims.n_ff),
        expert_weights_norm=arch != "qwen2moe",
        n_ff_shexp=int(meta("expert_shared_feed_forward_length", 0) or 0),
    )


def load_gguf(
    path: str | os.PathLike[str], dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
    skip: Callable[[str], bool] | None = None,
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read, dequantize and re-layout every tensor of a GGUF model; a tensor ``skip``
    names stays in the file (an empty placeholder with its leading dimension)."""
    import gguf  # local: gguf's reader only when a file is read here

    device = torch.device(device)
    try:
        reader = gguf.GGUFReader(str(path))
    except FileNotFoundError:
        raise ModelNotFound(f"No model file at {path}.") from None
    except (ValueError, OSError) as exc:
        raise ModelFormatError(f"{path} is not a readable GGUF file: {exc}") from None
    shapes = {t.name: tuple(reversed([int(d) for d in t.shape])) for t in reader.tensors}
    if "token_embd.weight" not in shapes:
        raise ModelFormatError(f"{path} has no token_embd.weight: not a language model GGUF.")
    cfg = gguf_config(reader, shapes)
    weights: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if skip is not None and skip(t.name):
            weights[t.name] = torch.empty((shapes[t.name][0], 0, 0), dtype=dtype, device=device)
            continue
        try:
            data = gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType(int(t.tensor_type)))
        except NotImplementedError:
            raise UnsupportedModel(
                f"{Path(path).name}: tensor {t.name} has type {t.tensor_type.name}, which gguf cannot dequantize."
            ) from None
        data = np.asarray(data, dtype=np.float32).reshape(shapes[t.name])
        if cfg.arch in INTERLEAVED_ROPE_ARCHS and (".attn_q." in t.name or ".attn_k." in t.name):
            heads = cfg.n_head if ".attn_q." in t.name else cfg.n_head_kv
            data = unpermute_rope(data, heads, cfg.rotary_dim)
        weights[t.name] = _to_torch(data, dtype, device)
    return cfg, weights


# -- Hugging Face --------------------------------------------------------------------
HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",  # Mixtral router
    "mlp.gate.weight": "ffn_gate_inp.weight",  # Qwen2-MoE router
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
HF_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
EXPERT_PARTS = {  # (HF infix, projection) -> GGUF stack name
    ("block_sparse_moe.experts", "w1"): "ffn_gate_exps.weight",
    ("block_sparse_moe.experts", "w3"): "ffn_up_exps.weight",
    ("block_sparse_moe.experts", "w2"): "ffn_down_exps.weight",
    ("mlp.experts", "gate_proj"): "ffn_gate_exps.weight",
    ("mlp.experts", "up_proj"): "ffn_up_exps.weight",
    ("mlp.experts", "down_proj"): "ffn_down_exps.weight",
}
HF_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen2_moe": "qwen2moe"}


def hf_config(raw: dict) -> ModelConfig:
    model_type = raw.get("model_type", "")
    if model_type not in HF_MODEL_TYPES:
        raise UnsupportedModel(f"The torch engine runs Llama-family checkpoints; config.json says {model_type!r}.")
    if raw.get("rope_scaling"):
        raise UnsupportedModel(f"RoPE scaling {raw['rope_scaling']!r} is not supported by the torch engine yet.")
    dims = dims_from_hf(raw)
    return ModelConfig(
        **dims.dims(),
        arch=HF_MODEL_TYPES[model_type],
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        rope_dim=int(dims.head_dim * float(raw.get("partial_rotary_factor", 1.0))),
        n_experts=int(raw.get("num_local_experts") or raw.get("num_experts") or 0),
        n_experts_used=int(raw.get("num_experts_per_tok", 0) or 0),
        n_ff_exp=int(raw.get("moe_intermediate_size") or raw.get("intermediate_size", 0)),
        expert_weights_norm=bool(raw.get("norm_topk_prob", model_type != "qwen2_moe")),
        n_ff_shexp=int(raw.get("shared_expert_intermediate_size", 0) or 0),
    )


def hf_name(name: str) -> tuple[str, tuple[int, str] | None] | None:
    """GGUF name for an HF tensor name, or (stack name, (expert, proj)) for an expert part."""
    if name in HF_GLOBAL_NAMES:
        return HF_GLOBAL_NAMES[name], None
    parts = name.split(".")
    if len(parts) < 4 or parts[:2] != ["model", "layers"]:
        return None
    layer, rest = parts[2], ".".join(parts[3:])
    if rest in HF_LAYER_NAMES:
        return f"blk.{layer}.{HF_LAYER_NAMES[rest]}", None
    for (infix, proj), stack in EXPERT_PARTS.items():
        head = infix + "."
        if rest.startswith(head) and rest.endswith(f".{proj}.weight"):
            expert = int(rest[len(head) :].split(".")[0])
            return f"blk.{layer}.{stack}", (expert, proj)
    return None


def load_hf(
    folder: str | os.PathLike[str], dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read config.json and every *.safetensors file of a Hugging Face checkpoint folder."""
    from safetensors import safe_open  # local: the [torch] extra

    folder, device = Path(folder), torch.device(device)
    try:
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelNotFound(f"{folder} has no config.json: not a Hugging Face model folder.") from None
    except json.JSONDecodeError as exc:
        raise ModelFormatError(f"{folder / 'config.json'} is not valid JSON: {exc}") from None
    cfg = hf_config(raw)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{folder} has no .safetensors weights.")
    weights: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                mapped = hf_name(name)
                if mapped is None:
                    continue
                tensor = f.get_tensor(name).to(device=device, dtype=dtype)
                target, part = mapped
                if part is None:
                    weights[target] = tensor
                else:
                    experts.setdefault(target, {})[part[0]] = tensor
    for stack, by_expert in experts.items():
        weights[stack] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    if "token_embd.weight" not in weights:
        if "output.weight" not in weights:
            raise ModelFormatError(f"{folder}: neither model.embed_tokens.weight nor lm_head.weight is stored.")
        weights["token_embd.weight"] = weights.pop("output.weight")  # tied: only the head was saved
    elif raw.get("tie_word_embeddings") and "output.weight" in weights:
        del weights["output.weight"]  # the model reuses the embedding; keep one copy
    return cfg, weights


def load_weights(
    path: str | os.PathLike[str], dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
    skip: Callable[[str], bool] | None = None,
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A GGUF file or a Hugging Face folder, whichever ``path`` is (``skip``: GGUF only)."""
    p = Path(path)
    if p.is_dir():
        return load_hf(p, dtype, device)
    if not p.exists():
        raise ModelNotFound(f"No model at {p}.")
    return load_gguf(p, dtype, device, skip)
