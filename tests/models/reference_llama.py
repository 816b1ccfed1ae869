"""A plain torch forward pass of a Hugging Face Llama checkpoint, used only as a test oracle.

Written from the Llama definition (RMSNorm, rotate-half RoPE on the HF weight layout,
grouped-query causal attention, SwiGLU MLP), independent of the GGUF converter and of
llama.cpp, so agreement between the two is evidence that the conversion is right.
No KV cache: every step recomputes the whole sequence, in float64 by default.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file


class ReferenceLlama:
    def __init__(self, folder: str | Path, dtype: torch.dtype = torch.float64) -> None:
        folder = Path(folder)
        self.cfg = json.loads((folder / "config.json").read_text())
        weights: dict[str, torch.Tensor] = {}
        for f in sorted(folder.glob("*.safetensors")):
            weights.update(load_file(str(f)))
        self.w = {k: v.to(dtype) for k, v in weights.items()}
        if "model.embed_tokens.weight" not in self.w:
            self.w["model.embed_tokens.weight"] = self.w["lm_head.weight"]
        if "lm_head.weight" not in self.w or self.cfg.get("tie_word_embeddings"):
            self.w["lm_head.weight"] = self.w["model.embed_tokens.weight"]
        self.dtype = dtype
        c = self.cfg
        self.n_head = c["num_attention_heads"]
        self.n_kv = c.get("num_key_value_heads", self.n_head)
        self.head_dim = c.get("head_dim") or c["hidden_size"] // self.n_head
        self.eps = c["rms_norm_eps"]
        self.theta = c.get("rope_theta", 10000.0)

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        # x: (heads, T, head_dim); HF rotate_half: pairs are (i, i + head_dim/2)
        t = x.shape[1]
        half = self.head_dim // 2
        inv = 1.0 / (self.theta ** (torch.arange(0, half, dtype=torch.float64) * 2 / self.head_dim))
        ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None, :]
        cos = torch.cat([ang.cos(), ang.cos()], -1).to(self.dtype)
        sin = torch.cat([ang.sin(), ang.sin()], -1).to(self.dtype)
        rot = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rot * sin

    @torch.no_grad()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """Logits of the last position for the sequence ``ids``."""
        w, t = self.w, len(ids)
        x = w["model.embed_tokens.weight"][torch.tensor(ids)]
        mask = torch.full((t, t), float("-inf"), dtype=self.dtype).triu(1)
        group = self.n_head // self.n_kv
        for i in range(self.cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            h = self._rms(x, w[p + "input_layernorm.weight"])
            q = (h @ w[p + "self_attn.q_proj.weight"].T).view(t, self.n_head, self.head_dim).transpose(0, 1)
            k = (h @ w[p + "self_attn.k_proj.weight"].T).view(t, self.n_kv, self.head_dim).transpose(0, 1)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).view(t, self.n_kv, self.head_dim).transpose(0, 1)
            q, k = self._rope(q), self._rope(k)
            k = k.repeat_interleave(group, 0)
            v = v.repeat_interleave(group, 0)
            att = (q @ k.transpose(1, 2)) / self.head_dim**0.5 + mask
            o = (att.softmax(-1) @ v).transpose(0, 1).reshape(t, -1)
            x = x + o @ w[p + "self_attn.o_proj.weight"].T
            h = self._rms(x, w[p + "post_attention_layernorm.weight"])
            gate = torch.nn.functional.silu(h @ w[p + "mlp.gate_proj.weight"].T)
            x = x + (gate * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
        x = self._rms(x[-1], w["model.norm.weight"])
        return x @ w["lm_head.weight"].T

    def greedy(self, ids: list[int], n: int) -> list[int]:
        """``n`` greedy continuation tokens of ``ids``."""
        seq, out = list(ids), []
        for _ in range(n):
            nxt = int(self.logits(seq).argmax())
            seq.append(nxt)
            out.append(nxt)
        return out
