"""What the exact llama.cpp configuration costs: prefill and decode speed, exact vs fast.

The exact configuration (``LlamaConfig.exact``, the default) keeps weights unrepacked and
flash attention off so that greedy speculative output is identical to plain greedy
output; the fast one lets llama.cpp repack weights for its batched CPU kernels. Both are
opened once and run alternately, so machine load hits both alike.

    .venv/bin/python benchmarks/exact_cost.py MODEL.gguf [--threads 1] [--reps 5] [-n 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from tandem.runtime.llama_backend import LlamaConfig, LlamaCppBackend

PROMPT = ("<|im_start|>user\nExplain, with a short Python example, how a hash map handles collisions, "
          "and compare open addressing with separate chaining in terms of memory and speed.<|im_end|>\n"
          "<|im_start|>assistant\n") * 3


def one_run(backend: LlamaCppBackend, ids: list[int], n: int) -> tuple[float, float]:
    backend.truncate(0)
    start = time.perf_counter()
    logits = backend.evaluate(ids)
    prefill_tps = len(ids) / (time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(n):
        logits = backend.evaluate([int(np.argmax(logits[-1]))])
    return prefill_tps, n / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("-n", type=int, default=64)
    args = ap.parse_args()
    backends = {name: LlamaCppBackend(args.model, LlamaConfig(n_ctx=1024, n_threads=args.threads, exact=exact))
                for name, exact in (("exact", True), ("fast", False))}
    ids = backends["exact"].tokenize(PROMPT, special=True)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in backends}
    for name in backends:  # warm-up
        one_run(backends[name], ids, 4)
    for _ in range(args.reps):
        for name, backend in backends.items():
            results[name].append(one_run(backend, ids, args.n))

    def summary(values: list[float]) -> str:
        return f"{statistics.median(values):7.1f} [{min(values):.1f}-{max(values):.1f}]"

    print(f"{args.model}  threads={args.threads}  prompt={len(ids)} tokens  decode={args.n} tokens  reps={args.reps}")
    for name, runs in results.items():
        print(f"{name:6s} prefill tok/s {summary([r[0] for r in runs])}   decode tok/s {summary([r[1] for r in runs])}")
    for i, what in enumerate(("prefill", "decode")):
        ratio = statistics.median(e[i] / f[i] for e, f in zip(results["exact"], results["fast"], strict=True))
        print(f"exact/fast {what}: {ratio:.2f}x (median of per-rep ratios)")
    for b in backends.values():
        b.close()


if __name__ == "__main__":
    main()
