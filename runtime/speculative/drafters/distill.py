"""Distil a tiny same-vocabulary drafter from a GGUF target (``tandem distill``).

The target writes many short sampled stories; a tiny Llama (1-2 layers, n_embd 64-96)
with the target's own tokenizer is trained on them with plain next-token cross-entropy
(torch, CPU, a few minutes at most), then written as a GGUF that carries the target's
tokenizer metadata verbatim, so ids mean the same bytes in both and the pair runs
through the same-vocabulary model drafter.

The model trained is the torch engine's own :class:`LlamaModel` (one torch Llama in
Tandem), its weights made trainable. That model rotates half-split pairs (Hugging Face's
layout), so q/k rows are permuted to llama.cpp's interleaved layout on writing, exactly
as ``tandem convert`` does for a Hugging Face checkpoint.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tandem.errors import TandemError
from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.backends.torch_engine.cache import PastCache
from tandem.runtime.backends.torch_engine.config import ModelConfig
from tandem.runtime.backends.torch_engine.decoder import LlamaModel
from tandem.runtime.generate import DoneEvent, generate

OnStep = Callable[[str, int, int], None]
"""Hears ``(stage, done, total)`` as a distillation goes (a progress bar's)."""


@dataclass
class DistillConfig:
    stories: int = 400
    story_tokens: int = 160
    temperature: float = 1.0
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_ff: int = 192
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


def generate_corpus(target, cfg: DistillConfig, on_step: OnStep | None = None) -> list[list[int]]:
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
        if on_step is not None:
            on_step("writing the corpus", i + 1, cfg.stories)
    return corpus


def build_model(vocab: int, cfg: DistillConfig, ctx: int) -> LlamaModel:
    """The torch engine's Llama at the drafter's size, randomly initialised (embedding
    N(0, 0.02), linear layers as ``nn.Linear`` starts them, norms at one), trainable."""
    model_cfg = ModelConfig(arch="llama", n_vocab=vocab, n_embd=cfg.n_embd, n_ff=cfg.n_ff, n_layer=cfg.n_layer,
                            n_head=cfg.n_head, n_head_kv=cfg.n_head, head_dim=cfg.n_embd // cfg.n_head,
                            n_ctx_train=ctx, tied=True, norm_eps=1e-5, rope_theta=10000.0)
    gen = torch.Generator().manual_seed(cfg.seed)

    def linear(rows: int, cols: int) -> torch.Tensor:
        bound = 1.0 / math.sqrt(cols)
        return (torch.rand(rows, cols, generator=gen) * 2 - 1) * bound

    e, f = cfg.n_embd, cfg.n_ff
    weights = {"token_embd.weight": torch.randn(vocab, e, generator=gen) * 0.02, "output_norm.weight": torch.ones(e)}
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        weights |= {p + "attn_norm.weight": torch.ones(e), p + "ffn_norm.weight": torch.ones(e),
                    p + "attn_q.weight": linear(e, e), p + "attn_k.weight": linear(e, e),
                    p + "attn_v.weight": linear(e, e), p + "attn_output.weight": linear(e, e),
                    p + "ffn_gate.weight": linear(f, e), p + "ffn_up.weight": linear(f, e),
                    p + "ffn_down.weight": linear(e, f)}
    model = LlamaModel(model_cfg, weights)
    for param in model.parameters():
        param.requires_grad_(True)
    return model


def window_logits(model: LlamaModel, ids: torch.Tensor) -> torch.Tensor:
    """Logits (B, T, vocab) for a batch of windows: the engine runs one sequence at a
    time, each from position 0 with an empty cache (causal attention over the window)."""
    cfg, out = model.cfg, []
    positions = torch.arange(ids.shape[1])
    for row in ids:
        empty = [torch.zeros(cfg.n_head_kv, 0, cfg.head_dim) for _ in range(cfg.n_layer)]
        out.append(model(model.embed(row), positions, PastCache(empty, list(empty))))
    return torch.stack(out)


def train(model: LlamaModel, corpus: list[list[int]], cfg: DistillConfig,
          on_step: OnStep | None = None) -> tuple[int, float, float]:
    """Next-token CE on random windows of the concatenated corpus; returns (steps, first, last loss)."""
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
        loss = torch.nn.functional.cross_entropy(window_logits(model, x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        last = loss.item()
        first = last if step == 1 else first
        if on_step is not None:
            on_step("training", step, cfg.steps)
        if cfg.seconds is not None and time.perf_counter() - start > cfg.seconds:
            break
    return step if cfg.steps else 0, first, last


def write_gguf(model: LlamaModel, target_path: Path, out: Path) -> Path:
    """Write the model as a llama GGUF with the target's tokenizer metadata copied verbatim."""
    import gguf  # local: gguf's reader only when a file is read here

    from tandem.models.convert import LlamaHParams, add_llama_hparams, permute_qk

    cfg = model.cfg
    reader = gguf.GGUFReader(target_path)
    hp = LlamaHParams(**cfg.dims(), rms_eps=cfg.norm_eps, rope_theta=cfg.rope_theta)
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

    def array(t: torch.Tensor) -> np.ndarray:
        return t.detach().float().numpy()

    tensors = {"token_embd.weight": array(model.tok_embd), "output_norm.weight": array(model.output_norm)}
    for i, blk in enumerate(model.blocks):
        p = f"blk.{i}."
        tensors |= {p + "attn_norm.weight": array(blk.attn_norm),
                    p + "attn_q.weight": permute_qk(array(blk.wq), cfg.n_head),
                    p + "attn_k.weight": permute_qk(array(blk.wk), cfg.n_head_kv),
                    p + "attn_v.weight": array(blk.wv), p + "attn_output.weight": array(blk.wo),
                    p + "ffn_norm.weight": array(blk.ffn_norm), p + "ffn_gate.weight": array(blk.w_gate),
                    p + "ffn_up.weight": array(blk.w_up), p + "ffn_down.weight": array(blk.w_down)}
    for name, arr in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, out)
    return out


def distill(target_path: str | os.PathLike[str], out: str | os.PathLike[str], cfg: DistillConfig | None = None,
            on_step: OnStep | None = None) -> DistillReport:
    """Generate a corpus with the target, train the drafter, write it to ``out``.
    ``on_step(stage, done, total)`` hears each story written and each training step
    (minutes of work: the CLI's progress bar)."""
    # local: loads llama.cpp only when this runs
    from tandem.runtime.backends.llama import LlamaCppBackend
    from tandem.runtime.backends.llama_config import LlamaConfig

    cfg = cfg or DistillConfig()
    target_path, out = Path(target_path), Path(out)
    if cfg.n_embd % cfg.n_head or (cfg.n_embd // cfg.n_head) % 2:
        raise TandemError("--dim must be a multiple of 2 x --heads.")
    t0 = time.perf_counter()
    # One thread: the model is tiny, and on a shared CPU extra threads only spin.
    with LlamaCppBackend(target_path, LlamaConfig(n_ctx=max(256, cfg.story_tokens + 8), n_threads=1)) as target:
        corpus = generate_corpus(target, cfg, on_step)
        vocab = target.n_vocab
        ctx = int(target.info.arch_value("context_length", 2048) or 2048)
    t1 = time.perf_counter()
    model = build_model(vocab, cfg, ctx)
    steps, first, last = train(model, corpus, cfg, on_step) if cfg.steps else (0, math.nan, math.nan)
    t2 = time.perf_counter()
    write_gguf(model, target_path, out)
    return DistillReport(sum(map(len, corpus)), steps, first, last, t1 - t0, t2 - t1, out)
