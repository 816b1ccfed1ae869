"""MoE expert offloading benchmark at a budget holding a fraction (default 25 %) of the experts.

Settings, run alternately (medians of tokens/s over repeats, the machine is shared):
  * in-memory: every expert resident (the engine's DenseExperts), the ceiling;
  * load-on-demand: no cache, no prefetch (every routed expert is read when needed);
  * LRU cache at the budget, no prefetch; HOBBIT eviction at the budget, no prefetch;
  * HOBBIT eviction + cross-layer-gate prefetch at the budget;
  * the same + mixed precision (low-weight misses load a low-bit copy).
Quality: teacher-forced next-token KL and top-1 agreement against in-memory, and
perplexity on the held-out story text of benchmarks/kv_compression.py (written by hand).

    .venv/bin/python -m benchmarks.moe_offload --model .bench/stories260K-twin-30M-moe8x2.gguf [--device cuda]

One backend serves every setting (the resident experts are swapped for an offloaded
store and back), and one expert source and one set of low-bit copies are shared, so a
multi-GB model is loaded once. ``--source ram`` (the default on CUDA) keeps the experts
in pinned host RAM, from which host-to-device copies are asynchronous; ``gguf`` (the
default on CPU) reads them from the file's mmap. On CUDA, load-on-demand copies every
routed expert host-to-device on every use, and in-memory keeps all experts on the GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.kv_compression import HELD_OUT, log_softmax
from tandem.runtime.backends.torch_engine.backend import TorchBackend, TorchConfig
from tandem.runtime.moe.config import OffloadConfig
from tandem.runtime.moe.expert_cache import (
    enable_offload,
    moe_layers,
    ram_source,
)
from tandem.runtime.moe.expert_store import GGUFExpertSource, LowBitExperts


def settings(budget: int, low_bits: int) -> dict[str, OffloadConfig | None]:
    return {
        "in-memory (all experts resident)": None,
        "load-on-demand (no cache)": OffloadConfig(budget_bytes=0, prefetch=False),
        "LRU cache 25%": OffloadConfig(budget_bytes=budget, eviction="lru", prefetch=False),
        "HOBBIT cache 25%, no prefetch": OffloadConfig(budget_bytes=budget, prefetch=False),
        "HOBBIT cache 25% + prefetch": OffloadConfig(budget_bytes=budget, prefetch=True),
        f"HOBBIT + prefetch + int{low_bits} low-weight misses": OffloadConfig(
            budget_bytes=budget, prefetch=True, mixed_precision=True, low_bits=low_bits, low_weight=0.5),
    }


def run(b: TorchBackend, prompt: list[int], tokens: list[int]) -> tuple[np.ndarray, float]:
    b.truncate(0)
    rows = [b.evaluate(prompt)[-1]]
    t0 = time.perf_counter()
    for t in tokens[:-1]:
        rows.append(b.evaluate([t])[-1])
    if b.device.type == "cuda":
        torch.cuda.synchronize()
    return np.stack(rows), (len(tokens) - 1) / (time.perf_counter() - t0)


def ppl(b: TorchBackend, held: list[int]) -> float:
    hl, _ = run(b, held[:1], held[1:] + [0])
    return float(np.exp(-log_softmax(hl.astype(np.float64))[np.arange(len(held) - 1), held[1:]].mean()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--source", choices=("gguf", "ram"), default=None, help="default: ram on CUDA, gguf on CPU")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--held-out", type=int, default=256, help="held-out tokens for perplexity")
    ap.add_argument("--fraction", type=float, default=0.25)
    ap.add_argument("--low-bits", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dense", type=Path, default=None, help="the dense source, to report what MoEfication cost")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cuda = torch.device(args.device).type == "cuda"
    source = args.source or ("ram" if cuda else "gguf")
    b = TorchBackend(args.model, TorchConfig(device=args.device))
    ffns = moe_layers(b)
    resident = [f.store for f in ffns]
    src = ram_source(b) if source == "ram" else GGUFExpertSource(args.model)
    one = src.load(0, 0)[0].nbytes
    n_total = src.n_layer * src.n_experts
    budget = int(round(args.fraction * n_total)) * one
    cfgs = settings(budget, args.low_bits)
    low = LowBitExperts(src, args.low_bits, b.device)
    prompt = b.tokenize("Once upon a time", add_bos=True)
    logits = b.evaluate(prompt)[-1]
    gen = []
    for _ in range(args.tokens):
        gen.append(int(logits.argmax()))
        logits = b.evaluate(gen[-1:])[-1]
    held = b.tokenize(HELD_OUT, add_bos=True)[: args.held_out]
    if args.dense is not None:
        print(f"dense source {args.dense.name}: held-out PPL {ppl(TorchBackend(args.dense, TorchConfig(device=args.device)), held):.3f}")
    gpu = f" ({torch.cuda.get_device_name(b.device)}, torch {torch.__version__})" if cuda else ""
    print(f"model {args.model.name} ({args.model.stat().st_size / 1e9:.2f} GB) on {args.device}{gpu}: "
          f"{src.n_layer} layers x {src.n_experts} experts, top-{b.model_config.n_experts_used}, "
          f"expert {one / 1e6:.2f} MB, all experts {n_total * one / 1e9:.2f} GB, budget {budget / 1e6:.1f} MB "
          f"({budget // one} of {n_total} experts), source {source}")
    speeds: dict[str, list[float]] = {k: [] for k in cfgs}
    rows: dict[str, tuple] = {}
    base_logp = None
    for rep in range(args.repeats):
        for name, cfg in cfgs.items():
            for f, store in zip(ffns, resident, strict=True):
                f.store = store
            mgr = enable_offload(b, cfg, src, low) if cfg is not None else None
            lg, tps = run(b, prompt, gen)
            speeds[name].append(tps)
            if rep == 0:
                logp = log_softmax(lg.astype(np.float64))
                base_logp = logp if base_logp is None else base_logp
                kl = float((np.exp(base_logp) * (base_logp - logp)).sum(-1).mean())
                agree = float((logp.argmax(-1) == base_logp.argmax(-1)).mean())
                s = mgr.stats if mgr else None
                per_tok = s.bytes_loaded / len(gen) if s else 0.0
                if s:
                    print(f"  {name}: {s.misses} misses, {s.prefetch_loads} prefetch loads, "
                          f"{s.prefetch_hits} prefetch hits ({s.waited} still in flight), "
                          f"{s.low_precision} low-bit loads, {mgr.cache.evictions} evictions", flush=True)
                rows[name] = (s.hit_rate if s else 1.0, s.prefetch_recall if s and cfg.prefetch else None,
                              per_tok, s.low_precision if s else 0, kl, agree, ppl(b, held))
            if mgr:
                mgr.close()
    lod = statistics.median(speeds["load-on-demand (no cache)"])
    print("| setting | hit rate | prefetch recall | bytes read/token | low-bit loads | KL vs in-memory | top-1 agree | held-out PPL | tokens/s (median) | vs load-on-demand |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, (hit, rec, per_tok, n_low, kl, agree, pp) in rows.items():
        tps = statistics.median(speeds[name])
        rec_s = "-" if rec is None else f"{rec:.2f}"
        print(f"| {name} | {hit:.2f} | {rec_s} | {per_tok / 1e6:.2f} MB | {n_low} | {kl:.4f} | {agree:.3f} | {pp:.3f} | "
              f"{tps:.1f} | {tps / lod:.2f}x |")
    print("tokens/s per repeat: " + "; ".join(f"{k}: {', '.join(f'{v:.1f}' for v in vs)}" for k, vs in speeds.items()))


if __name__ == "__main__":
    main()
