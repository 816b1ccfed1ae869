"""What the exact llama.cpp configuration costs: prefill and decode speed, exact vs fast.

The exact configuration (``LlamaConfig.exact``, the default) keeps weights unrepacked and
flash attention off so that greedy speculative output is identical to plain greedy
output; the fast one lets llama.cpp repack weights for its batched CPU kernels. Both are
opened once and run alternately, so machine load hits both alike.

    .venv/bin/python benchmarks/exact_cost.py MODEL.gguf [--threads 1] [--reps 5] [-n 64]
    .venv/bin/python benchmarks/exact_cost.py MODEL.gguf --batch-vs-steps [--fast]
    .venv/bin/python benchmarks/exact_cost.py MODEL.gguf --load [--threads 1] [--reps 5]

``--batch-vs-steps``: max |logit difference| between a batch of m tokens and m one-token
steps over the same context, for m = 1..64 (0 means bit-identical).
``--load``: seconds to open the model and peak resident memory, each configuration in a
fresh child process (repacking copies the weights it repacks out of the memory map).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_config import LlamaConfig
from tandem.runtime.backends.selfcheck import batch_step_difference

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


def batch_vs_steps(backend: LlamaCppBackend, ids: list[int]) -> dict[int, float]:
    return {m: batch_step_difference(backend, ids, m) for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 32, 64)}


def load_in_child(model: str, exact: bool, threads: int) -> tuple[float, float]:
    """(seconds to open ``model`` and decode one token, peak RSS in MiB) in a fresh process."""
    argv = [sys.executable, __file__, model, "--child-load", "exact" if exact else "fast", "--threads", str(threads)]
    start = time.perf_counter()
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"the child loading {model} failed")
    return time.perf_counter() - start, usage.ru_maxrss / 1024


def child_load(model: str, exact: bool, threads: int) -> None:
    with LlamaCppBackend(model, LlamaConfig(n_ctx=1024, n_threads=threads, exact=exact)) as b:
        b.evaluate(b.tokenize("Hello", special=True))


def compare_loads(model: str, threads: int, reps: int) -> None:
    load_in_child(model, True, threads)  # the file into the page cache
    results: dict[str, list[tuple[float, float]]] = {"exact": [], "fast": []}
    for _ in range(reps):
        for name in results:
            results[name].append(load_in_child(model, name == "exact", threads))
    print(f"{model}  threads={threads}  reps={reps}  (a fresh process each: start Python, open, one token)")
    for name, runs in results.items():
        seconds, peaks = [r[0] for r in runs], [r[1] for r in runs]
        print(f"{name:6s} open s {statistics.median(seconds):.2f} [{min(seconds):.2f}-{max(seconds):.2f}]   "
              f"peak RSS MiB {statistics.median(peaks):.0f} [{min(peaks):.0f}-{max(peaks):.0f}]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--batch-vs-steps", action="store_true")
    ap.add_argument("--fast", action="store_true", help="with --batch-vs-steps: the fast configuration")
    ap.add_argument("--load", action="store_true", help="open time and peak RSS, a child process each")
    ap.add_argument("--child-load", choices=("exact", "fast"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_load:
        child_load(args.model, args.child_load == "exact", args.threads)
        return
    if args.load:
        compare_loads(args.model, args.threads, args.reps)
        return
    if args.batch_vs_steps:
        with LlamaCppBackend(args.model, LlamaConfig(n_ctx=1024, n_threads=args.threads, exact=not args.fast)) as b:
            diffs = batch_vs_steps(b, b.tokenize(PROMPT, special=True))
        print({m: round(d, 6) for m, d in diffs.items()})
        return
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
