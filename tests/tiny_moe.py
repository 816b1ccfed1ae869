"""A tiny mixture-of-experts GGUF written on the fly: llama.cpp's Llama architecture with
``expert_count`` set (Mixtral's layout), random F32 weights and a byte-level vocabulary.

Small enough to load in well under a second, real enough that llama.cpp routes every
token through ``ffn_gate_inp`` and its ``ffn_{gate,up,down}_exps`` tensors, which is all
the expert placement code touches."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tandem.runtime.backends.selfcheck import add_byte_vocab

N_EMBD, N_FF, N_LAYER, N_HEAD, N_EXPERT, N_USED = 64, 128, 3, 4, 4, 2


def write_tiny_moe(path: Path, seed: int = 0, *, n_expert: int = N_EXPERT, arch: str = "llama") -> Path:
    """A Llama GGUF with ``n_expert`` experts per layer (0: a dense FFN instead);
    ``arch="qwen3moe"``: Qwen3-MoE's layout (per-head q/k norms, its own expert width),
    the shape of Qwen3-30B-A3B."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tandem-tiny-moe" if n_expert else "tandem-tiny-dense")
    w.add_context_length(256)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD)
    w.add_rope_dimension_count(N_EMBD // N_HEAD)
    w.add_layer_norm_rms_eps(1e-5)
    if n_expert:
        w.add_expert_count(n_expert)
        w.add_expert_used_count(N_USED)
        if arch == "qwen3moe":
            w.add_expert_feed_forward_length(N_FF)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    n_vocab = add_byte_vocab(w)

    def mat(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    w.add_tensor("token_embd.weight", rng.standard_normal((n_vocab, N_EMBD)).astype(np.float32))
    for i in range(N_LAYER):
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(f"blk.{i}.{name}.weight", mat(N_EMBD, N_EMBD))
        if arch == "qwen3moe":
            for name in ("attn_q_norm", "attn_k_norm"):
                w.add_tensor(f"blk.{i}.{name}.weight", np.ones(N_EMBD // N_HEAD, dtype=np.float32))
        if n_expert:
            w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", mat(n_expert, N_EMBD))
            w.add_tensor(f"blk.{i}.ffn_gate_exps.weight", mat(n_expert, N_FF, N_EMBD))
            w.add_tensor(f"blk.{i}.ffn_up_exps.weight", mat(n_expert, N_FF, N_EMBD))
            w.add_tensor(f"blk.{i}.ffn_down_exps.weight", mat(n_expert, N_EMBD, N_FF))
        else:
            w.add_tensor(f"blk.{i}.ffn_gate.weight", mat(N_FF, N_EMBD))
            w.add_tensor(f"blk.{i}.ffn_up.weight", mat(N_FF, N_EMBD))
            w.add_tensor(f"blk.{i}.ffn_down.weight", mat(N_EMBD, N_FF))
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    w.add_tensor("output.weight", 4 * mat(n_vocab, N_EMBD))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
