"""Distil a tiny same-vocabulary drafter from a GGUF target (``tandem distill``).

The target writes many short sampled stories; a tiny Llama (1-2 layers, dim 64-96)
with the target's own tokenizer is trained on them with plain next-token cross-entropy
(torch, CPU, a few minutes at most), then written as a GGUF that carries the target's
tokenizer metadata verbatim, so ids mean the same bytes in both and the pair runs
through the same-vocabulary model drafter.

The torch model rotates adjacent pairs (llama.cpp's native RoPE layout), so its
q/k weights are written without the HF permutation.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tandem.kernels.sampling import Sampler, SamplingParams
from tandem.models.errors import TandemError
from tandem.runtime.generate import DoneEvent, generate


@dataclass
class DistillConfig:
    stories: int = 400
    story_tokens: int = 160
    temperature: float = 1.0
    dim: int = 64
    layers: int = 2
    heads: int = 4
    ffn: int = 192
    steps: int = 600
    batch: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    seconds: float | None = 240.0
    """Wall-clock cap on training (the step count is the other cap)."""
    seed: int = 0


@dataclass
class DistillReport:
    corpus_tokens: int
    steps: int
    loss_first: float
    loss_last: float
    gen_s: float
    train_s: float
    out: Path


def generate_corpus(target, cfg: DistillConfig) -> list[list[int]]:
    """Sampled stories from the target, each starting with BOS (and ending with EOS if it stopped)."""
    bos, eos = target.special.bos, target.special.eos
    if bos is None:
        raise TandemError(f"{target.name} has no BOS token to start stories from.")
    corpus: list[list[int]] = []
    for i in range(cfg.stories):
        # A seed fixes the draw at each position, so each story needs its own (seed + i):
        # one seed for all would sample the same story every time.
        params = SamplingParams(temperature=cfg.temperature, top_k=0, top_p=1.0, min_p=0.0, seed=cfg.seed + i)
        done = [e for e in generate(target, [bos], Sampler(params), max_tokens=cfg.story_tokens)
                if isinstance(e, DoneEvent)][0]
        story = [bos, *done.tokens]
        if done.stats.finish_reason == "stop" and eos is not None:
            story.append(eos)
        corpus.append(story)
    return corpus


def _build_model(vocab: int, cfg: DistillConfig, ctx: int):
    import torch
    from torch import nn

    head_dim = cfg.dim // cfg.heads
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    ang = torch.outer(torch.arange(ctx).float(), inv)
    cos, sin = ang.cos(), ang.sin()

    def rope(x: torch.Tensor) -> torch.Tensor:  # (B, H, T, D), adjacent pairs as llama.cpp
        t = x.shape[2]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        c, s = cos[:t], sin[:t]
        return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn_norm = nn.RMSNorm(cfg.dim, eps=1e-5)
            self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
            self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
            self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
            self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
            self.ffn_norm = nn.RMSNorm(cfg.dim, eps=1e-5)
            self.gate = nn.Linear(cfg.dim, cfg.ffn, bias=False)
            self.up = nn.Linear(cfg.dim, cfg.ffn, bias=False)
            self.down = nn.Linear(cfg.ffn, cfg.dim, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            h = self.attn_norm(x)

            def split(w: nn.Linear) -> torch.Tensor:
                return w(h).view(b, t, cfg.heads, head_dim).transpose(1, 2)

            att = nn.functional.scaled_dot_product_attention(rope(split(self.wq)), rope(split(self.wk)), split(self.wv), is_causal=True)
            x = x + self.wo(att.transpose(1, 2).reshape(b, t, cfg.dim))
            h = self.ffn_norm(x)
            return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))

    class TinyLlama(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, cfg.dim)
            nn.init.normal_(self.embed.weight, std=0.02)
            self.blocks = nn.ModuleList(Block() for _ in range(cfg.layers))
            self.norm = nn.RMSNorm(cfg.dim, eps=1e-5)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.embed(ids)
            for blk in self.blocks:
                x = blk(x)
            return self.norm(x) @ self.embed.weight.T  # tied output, as token_embd in GGUF

    return TinyLlama()


def train(model, corpus: list[list[int]], cfg: DistillConfig) -> tuple[int, float, float]:
    """Next-token CE on random windows of the concatenated corpus; returns (steps, first, last loss)."""
    import torch

    torch.manual_seed(cfg.seed)
    torch.set_num_threads(1)  # tiny matrices: more threads only contend on a shared CPU
    data = torch.tensor([t for story in corpus for t in story], dtype=torch.long)
    if len(data) < cfg.seq_len + 2:
        raise TandemError("The generated corpus is too small to train on; raise --stories.")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(cfg.seed)
    start, first, last, step = time.perf_counter(), math.nan, math.nan, 0
    for step in range(1, cfg.steps + 1):
        lr = cfg.lr * min(1.0, step / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / cfg.steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        idx = torch.randint(0, len(data) - cfg.seq_len - 1, (cfg.batch,), generator=gen)
        x = torch.stack([data[i : i + cfg.seq_len] for i in idx])
        y = torch.stack([data[i + 1 : i + cfg.seq_len + 1] for i in idx])
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        last = loss.item()
        first = last if step == 1 else first
        if cfg.seconds is not None and time.perf_counter() - start > cfg.seconds:
            break
    return step if cfg.steps else 0, first, last


def write_gguf(model, cfg: DistillConfig, target_path: Path, out: Path, ctx: int) -> Path:
    """Write the model as a llama GGUF with the target's tokenizer metadata copied verbatim."""
    import gguf

    from tandem.models.convert import LlamaHParams, add_llama_hparams

    reader = gguf.GGUFReader(target_path)
    vocab = model.embed.weight.shape[0]
    hp = LlamaHParams(vocab_size=vocab, hidden=cfg.dim, ffn=cfg.ffn, layers=cfg.layers, heads=cfg.heads,
                      kv_heads=cfg.heads, head_dim=cfg.dim // cfg.heads, rms_eps=1e-5, rope_theta=10000.0,
                      context=ctx, tied=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".distill-", suffix=".gguf")
    os.close(fd)
    writer = gguf.GGUFWriter(tmp, "llama")
    writer.add_name(f"{target_path.stem}-distilled-drafter")
    writer.add_file_type(0)
    add_llama_hparams(writer, hp)
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    tensors = {"token_embd.weight": sd["embed.weight"], "output_norm.weight": sd["norm.weight"]}
    names = {"attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
             "ffn_norm": "ffn_norm", "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"}
    for i in range(cfg.layers):
        for ours, theirs in names.items():
            tensors[f"blk.{i}.{theirs}.weight"] = sd[f"blocks.{i}.{ours}.weight"]
    for name, arr in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, out)
    return out


def distill(target_path: str | os.PathLike[str], out: str | os.PathLike[str], cfg: DistillConfig | None = None) -> DistillReport:
    """Generate a corpus with the target, train the drafter, write it to ``out``."""
    from tandem.runtime.backends.llama import LlamaConfig, LlamaCppBackend

    cfg = cfg or DistillConfig()
    target_path, out = Path(target_path), Path(out)
    if cfg.dim % cfg.heads or (cfg.dim // cfg.heads) % 2:
        raise TandemError("--dim must be a multiple of 2 x --heads.")
    t0 = time.perf_counter()
    # One thread: the model is tiny, and on a shared CPU extra threads only spin.
    with LlamaCppBackend(target_path, LlamaConfig(n_ctx=max(256, cfg.story_tokens + 8), n_threads=1)) as target:
        corpus = generate_corpus(target, cfg)
        vocab = target.n_vocab
        ctx = int(target.info.arch_value("context_length", 2048) or 2048)
    t1 = time.perf_counter()
    model = _build_model(vocab, cfg, max(ctx, cfg.seq_len))
    steps, first, last = train(model, corpus, cfg) if cfg.steps else (0, math.nan, math.nan)
    t2 = time.perf_counter()
    write_gguf(model, cfg, target_path, out, ctx)
    return DistillReport(sum(map(len, corpus)), steps, first, last, t1 - t0, t2 - t1, out)
