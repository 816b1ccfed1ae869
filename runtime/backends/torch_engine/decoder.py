"""The Llama-family decoder (Llama 1-3, Mistral, Mixtral, Qwen2, Qwen2-MoE) in plain torch.

One sequence, no batch dimension: activations are ``(T, dim)``, per-head tensors
``(heads, T, head_dim)``. RMSNorm, half-split RoPE (the loaders bring Q/K weights to
that layout), grouped-query attention and SwiGLU (or a routed MoE feed-forward), the
way llama.cpp computes them. The KV cache is an argument, not part of the module, so
compressed caches plug in (see :mod:`.cache`) and the same code traces to ONNX.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tandem.runtime.backends.torch_engine.cache import KVCache
from tandem.runtime.backends.torch_engine.config import ModelConfig
from tandem.runtime.backends.torch_engine.moe_layer import (
    DenseExperts,
    MoEFeedForward,
    linear,
    swiglu,
)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def rope_tables(
    positions: torch.Tensor, rotary_dim: int, theta: float, freq_factors: torch.Tensor | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (T, rotary_dim/2), angles computed in float64 for accuracy.

    ``freq_factors`` (llama.cpp's ``rope_freqs.weight``, Llama 3.1 long-context scaling)
    divide the base frequencies.
    """
    half = rotary_dim // 2
    exponent = torch.arange(half, dtype=torch.float64, device=positions.device) * (2.0 / rotary_dim)
    inv_freq = 1.0 / (theta**exponent)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.to(torch.float64)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` dims of each head (half-split layout)."""
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def expand_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """(Hkv, S, D) -> (Hkv * groups, S, D): each KV head serves ``groups`` query heads."""
    if groups == 1:
        return t
    h, s, d = t.shape
    return t[:, None].expand(h, groups, s, d).reshape(h * groups, s, d)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, want_probs: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scaled dot-product attention with a boolean (T, S) mask; probabilities on request."""
    groups = q.shape[0] // k.shape[0]
    k, v = expand_kv(k, groups), expand_kv(v, groups)
    if not want_probs:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask), None
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return probs @ v, probs


class Block(nn.Module):
    """One transformer layer: attention then feed-forward, both pre-normed and residual."""

    def __init__(self, cfg: ModelConfig, layer: int, w: dict[str, torch.Tensor]) -> None:
        super().__init__()
        p = f"blk.{layer}."

        def param(name: str) -> nn.Parameter | None:
            t = w.get(p + name)
            return None if t is None else nn.Parameter(t, requires_grad=False)

        self.layer = layer
        self.cfg = cfg
        self.attn_norm, self.ffn_norm = param("attn_norm.weight"), param("ffn_norm.weight")
        self.wq, self.wk, self.wv = param("attn_q.weight"), param("attn_k.weight"), param("attn_v.weight")
        self.bq, self.bk, self.bv = param("attn_q.bias"), param("attn_k.bias"), param("attn_v.bias")
        self.wo = param("attn_output.weight")
        self.ffn: nn.Module | None = None
        if cfg.is_moe:
            shared = None
            if p + "ffn_gate_shexp.weight" in w:
                shared = (w[p + "ffn_gate_shexp.weight"], w[p + "ffn_up_shexp.weight"], w[p + "ffn_down_shexp.weight"])
            store = DenseExperts(w[p + "ffn_gate_exps.weight"], w[p + "ffn_up_exps.weight"], w[p + "ffn_down_exps.weight"])
            self.ffn = MoEFeedForward(
                layer, w[p + "ffn_gate_inp.weight"], store, cfg.n_experts_used,
                normalize=cfg.expert_weights_norm, shared=shared, shared_gate=w.get(p + "ffn_gate_inp_shexp.weight"),
            )
        else:
            self.w_gate, self.w_up, self.w_down = param("ffn_gate.weight"), param("ffn_up.weight"), param("ffn_down.weight")

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        new_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        cfg, t = self.cfg, x.shape[0]
        h = rms_norm(x, self.attn_norm, cfg.norm_eps)
        q = linear(h, self.wq, self.bq).view(t, cfg.n_head, cfg.head_dim).transpose(0, 1)
        k = linear(h, self.wk, self.bk).view(t, cfg.n_head_kv, cfg.head_dim).transpose(0, 1)
        v = linear(h, self.wv, self.bv).view(t, cfg.n_head_kv, cfg.head_dim).transpose(0, 1)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_all, v_all, key_pos = cache.update(self.layer, k, v, positions)
        if new_mask is None:  # causal: a key is visible iff it is not in the future
            mask = key_pos[None, :] <= positions[:, None]
        else:  # tree: all older entries visible, the new ones as the caller says
            older = torch.ones(t, k_all.shape[1] - t, dtype=torch.bool, device=x.device)
            mask = torch.cat([older, new_mask], dim=1)
        out, probs = attend(q, k_all, v_all, mask, cache.wants_attention)
        if probs is not None:
            cache.observe_attention(self.layer, probs)
        x = x + linear(out.transpose(0, 1).reshape(t, cfg.n_head * cfg.head_dim), self.wo)
        h = rms_norm(x, self.ffn_norm, cfg.norm_eps)
        if self.ffn is not None:
            return x + self.ffn(h)
        return x + swiglu(h, self.w_gate, self.w_up, self.w_down)


class LlamaModel(nn.Module):
    """Embedding, blocks, final norm and output head."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embd = nn.Parameter(weights["token_embd.weight"], requires_grad=False)
        out = weights.get("output.weight")
        self.output = self.tok_embd if out is None else nn.Parameter(out, requires_grad=False)
        self.output_norm = nn.Parameter(weights["output_norm.weight"], requires_grad=False)
        freqs = weights.get("rope_freqs.weight")
        self.register_buffer("rope_freqs", freqs, persistent=False)
        self.blocks = nn.ModuleList(Block(cfg, i, weights) for i in range(cfg.n_layer))

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embd.dtype

    @property
    def device(self) -> torch.device:
        return self.tok_embd.device

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.tok_embd)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        new_mask: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Logits (R, vocab) for input embeddings ``x`` (T, dim) at absolute ``positions``.

        ``new_mask`` (T, T) says which new entries each new query sees (``None``: causal);
        ``rows`` picks the positions whose logits are wanted (``None``: all), and only
        those go through the output head. ``rope`` overrides the cos/sin tables (graph
        export gathers them from a precomputed table). The caller calls
        ``cache.commit`` afterwards.
        """
        cfg = self.cfg
        if rope is None:
            rope = rope_tables(positions, cfg.rotary_dim, cfg.rope_theta, self.rope_freqs, x.dtype)
        cos, sin = rope
        for block in self.blocks:
            x = block(x, cos, sin, positions, cache, new_mask)
        if rows is not None:
            x = x.index_select(0, rows)
        return linear(rms_norm(x, self.output_norm, cfg.norm_eps), self.output)

    def weight_bytes(self) -> int:
        seen: set[int] = set()
        total = 0
        for p in self.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
        return total
