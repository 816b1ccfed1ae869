"""Decode and prompt speed of llama.cpp's two lossless configurations against
llama-cpp-python's default, on one model and thread count.

- ``exact``: Tandem's backend, weights as stored (``LlamaConfig()``, verify calls of 7);
- ``repacked``: Tandem's backend, weights repacked (``LlamaConfig(repack=True)``, verify
  calls of 3);
- ``peer``: ``llama_cpp.Llama(model, n_threads=T, n_ctx=...)``, its defaults otherwise
  (which repack), timed through ``Llama.eval``.

All three are loaded in one process and measured in turn, round after round (the order
rotated), so the load of a shared machine hits all alike: a prompt of ``--prompt``
tokens in one evaluation (the speed of prompt processing), then ``--steps`` one-token
steps (decoding). Medians with the range; ratios are each round's against the peer's.
Run from the repository root: ``python -m benchmarks.kernels MODEL --threads 2``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

TEXT = ("def quicksort(items):\n    if len(items) <= 1:\n        return items\n    pivot = items[0]\n"
        "    left = [x for x in items[1:] if x < pivot]\n    right = [x for x in items[1:] if x >= pivot]\n"
        "    return quicksort(left) + [pivot] + quicksort(right)\n\n")


class Peer:
    def __init__(self, model: str, threads: int, n_ctx: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=model, n_threads=threads, n_ctx=n_ctx, verbose=False)

    def reset(self) -> None:
        self.llm.reset()
        self.llm._ctx.kv_cache_clear()

    def evaluate(self, tokens: list[int]) -> None:
        self.llm.eval(tokens)

    def close(self) -> None:
        self.llm.close()


class Ours:
    def __init__(self, model: str, threads: int, n_ctx: int, repack: bool) -> None:
        from tandem.runtime.backends.llama import LlamaCppBackend
        from tandem.runtime.backends.llama_config import LlamaConfig

        self.backend = LlamaCppBackend(model, LlamaConfig(n_ctx=n_ctx, n_threads=threads, repack=repack))

    def reset(self) -> None:
        self.backend.truncate(0)

    def evaluate(self, tokens: list[int]) -> None:
        self.backend.evaluate(tokens)

    def close(self) -> None:
        self.backend.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=900)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    n_ctx = args.prompt + args.steps + 16
    arms = {"exact": Ours(args.model, args.threads, n_ctx, False),
            "repacked": Ours(args.model, args.threads, n_ctx, True),
            "peer": Peer(args.model, args.threads, n_ctx)}
    tokens = arms["exact"].backend.tokenize(TEXT * 200)
    prompt = tokens[: args.prompt]
    prefill: dict[str, list[float]] = {n: [] for n in arms}
    decode: dict[str, list[float]] = {n: [] for n in arms}
    names = list(arms)
    try:
        for r in range(args.rounds + 1):  # round 0 warms up
            for name in names[r % 3:] + names[: r % 3]:
                arm = arms[name]
                arm.reset()
                start = time.perf_counter()
                arm.evaluate(prompt)
                p = len(prompt) / (time.perf_counter() - start)
                start = time.perf_counter()
                for i in range(args.steps):
                    arm.evaluate([tokens[args.prompt + i]])
                d = args.steps / (time.perf_counter() - start)
                if r:
                    prefill[name].append(p)
                    decode[name].append(d)
    finally:
        for arm in arms.values():
            arm.close()
    print(f"{Path(args.model).name}, {args.threads} threads, prompt {len(prompt)} tokens, {args.steps} steps, "
          f"{args.rounds} rounds; load {os.getloadavg()[0]:.2f}")
    for name in names:
        line = f"  {name:9s}"
        for label, xs in (("decode", decode[name]), ("prompt", prefill[name])):
            ratio = [a / b for a, b in zip(xs, (decode if label == "decode" else prefill)["peer"], strict=True)]
            line += (f"  {label} {statistics.median(xs):6.1f} tok/s ({min(xs):.1f}-{max(xs):.1f}), "
                     f"x{statistics.median(ratio):.2f} peer ({min(ratio):.2f}-{max(ratio):.2f})")
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({"decode": decode, "prefill": prefill}, indent=1))


if __name__ == "__main__":
    main()
