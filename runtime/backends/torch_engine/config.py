"""Hyperparameters of a decoder-only transformer, independent of the file it came from.

Weights are held under llama.cpp's GGUF tensor names (``token_embd.weight``,
``blk.N.attn_q.weight``, ``blk.N.ffn_gate_exps.weight``, ...) whatever the source, so
the Hugging Face loader translates names once and every other module speaks one dialect.
Linear weights are ``(out_features, in_features)`` as torch expects; expert stacks are
``(n_experts, out, in)``. Q/K weights are always in the *half-split* RoPE layout
(Hugging Face's ``rotate_half``); the GGUF loader undoes llama.cpp's interleaving.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.models.shape import DecoderShape


@dataclass(frozen=True, kw_only=True)
class ModelConfig(DecoderShape):
    """A decoder's dimensions (:class:`DecoderShape`, GGUF names) plus what the torch
    engine computes with: architecture, norm, RoPE and MoE routing."""

    arch: str
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_dim: int = 0
    """Leading dims of each head that RoPE rotates (0 means all of ``head_dim``)."""
    n_experts: int = 0
    n_experts_used: int = 0
    n_ff_exp: int = 0
    """Width of one expert's feed-forward (GGUF ``expert_feed_forward_length``)."""
    expert_weights_norm: bool = True
    """Renormalise the chosen experts' softmax weights to sum to 1 (Mixtral yes, Qwen2-MoE no)."""
    n_ff_shexp: int = 0
    """Width of the shared expert (GGUF ``expert_shared_feed_forward_length``)."""

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def rotary_dim(self) -> int:
        return self.rope_dim or self.head_dim
