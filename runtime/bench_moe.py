"""MoE expert offloading benchmark at a budget holding a fraction (default 25 %) of the experts.

Settings, run alternately (medians of tokens/s over repeats, the machine is shared):
  * in-memory: every expert resident (the engine's DenseExperts), the ceiling;
  * load-on-demand: no cache, no prefetch (every routed expert is read when needed);
  * LRU cache at the budget, no prefetch;
  * HOBBIT eviction + cross-layer-gate prefetch at the budget;
  * the same + mixed precision (low-weight misses load a low-bit copy).
Quality: teacher-forced next-token KL and top-1 agreement against in-memory, and
perplexity on the held-out story text of runtime/bench_kv.py (written by hand).

    .venv/bin/python -m tandem.runtime.bench_moe --model .bench/stories260K-twin-30M-moe8x2.gguf [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from tandem.runtime.bench_kv import HELD_OUT, log_softmax
from tandem.runtime.torch_engine.backend import TorchBackend, TorchConfig
from tandem.runtime.torch_engine.expert_cache import OffloadConfig, enable_offload
from tandem.runtime.torch_engine.expert_store import GGUFExpertSource


def settings(budget: int, low_bits: int) -> dict[str, tuple[OffloadConfig | None, str]]:
    return {
        "in-memory (all experts resident)": (None, ""),
        "load-on-demand (no cache)": (OffloadConfig(budget_bytes=0, prefetch=False), "gguf"),
        "LRU cache 25%": (OffloadConfig(budget_bytes=budget, eviction="lru", prefetch=False), "gguf"),
        "HOBBIT cache 25% + prefetch": (OffloadConfig(budget_bytes=budget, prefetch=True), "gguf"),
        f"HOBBIT + prefetch + int{low_bits} low-weight misses": (
            OffloadConfig(budget_bytes=budget, prefetch=True, mixed_precision=True, low_bits=low_bits, low_weight=0.5),
            "gguf",
        ),
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--fraction", type=float, default=0.25)
    ap.add_argument("--low-bits", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dense", type=Path, default=None, help="the dense source, to report what MoEfication cost")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    src = GGUFExpertSource(args.model)
    one = src.load(0, 0)[0].nbytes
    n_total = src.n_layers * src.n_experts
    budget = int(round(args.fraction * n_total)) * one
    ref = TorchBackend(args.model, TorchConfig(device=args.device))
    prompt = ref.tokenize("Once upon a time", add_bos=True)
    logits = ref.evaluate(prompt)[-1]
    gen = []
    for _ in range(args.tokens):
        gen.append(int(logits.argmax()))
        logits = ref.evaluate(gen[-1:])[-1]
    held = ref.tokenize(HELD_OUT, add_bos=True)[:256]
    cfgs = settings(budget, args.low_bits)
    if args.dense is not None:
        d = TorchBackend(args.dense, TorchConfig(device=args.device))
        hl, _ = run(d, held[:1], held[1:] + [0])
        ppl = float(np.exp(-log_softmax(hl.astype(np.float64))[np.arange(len(held) - 1), held[1:]].mean()))
        print(f"dense source {args.dense.name}: held-out PPL {ppl:.3f}")
    print(f"model {args.model.name} on {args.device}: {src.n_layers} layers x {src.n_experts} experts, "
          f"top-{ref.model_config.n_experts_used}, expert {one / 1e6:.2f} MB, budget {budget / 1e6:.1f} MB "
          f"({budget // one} of {n_total} experts)")
    speeds: dict[str, list[float]] = {k: [] for k in cfgs}
    rows: dict[str, tuple] = {}
    base_logp = None
    for rep in range(args.repeats):
        for name, (cfg, source) in cfgs.items():
            b = TorchBackend(args.model, TorchConfig(device=args.device))
            mgr = enable_offload(b, cfg, source) if cfg is not None else None
            lg, tps = run(b, prompt, gen)
            speeds[name].append(tps)
            if rep == 0:
                logp = log_softmax(lg.astype(np.float64))
                base_logp = logp if base_logp is None else base_logp
                kl = float((np.exp(base_logp) * (base_logp - logp)).sum(-1).mean())
                agree = float((logp.argmax(-1) == base_logp.argmax(-1)).mean())
                s = mgr.stats if mgr else None
                per_tok = s.bytes_loaded / len(gen) if s else 0.0
                hl, _ = run(b, held[:1], held[1:] + [0])
                ppl = float(np.exp(-log_softmax(hl.astype(np.float64))[np.arange(len(held) - 1), held[1:]].mean()))
                rows[name] = (s.hit_rate if s else 1.0, s.prefetch_recall if s and cfg.prefetch else None,
                              per_tok, s.low_precision if s else 0, kl, agree, ppl)
            if mgr:
                mgr.close()
    lod = statistics.median(speeds["load-on-demand (no cache)"])
    print("| setting | hit rate | prefetch recall | bytes read/token | low-bit loads | KL vs in-memory | top-1 agree | held-out PPL | tokens/s (median) | vs load-on-demand |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, (hit, rec, per_tok, low, kl, agree, ppl) in rows.items():
        tps = statistics.median(speeds[name])
        rec_s = "-" if rec is None else f"{rec:.2f}"
        print(f"| {name} | {hit:.2f} | {rec_s} | {per_tok / 1e6:.2f} MB | {low} | {kl:.4f} | {agree:.3f} | {ppl:.3f} | "
              f"{tps:.1f} | {tps / lod:.2f}x |")


if __name__ == "__main__":
    main()
