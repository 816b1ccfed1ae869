"""Host time a round of the cross-vocabulary drafter's own bookkeeping, by context length.

SmolLM2-135M drafting for Qwen2.5-Coder-1.5B: each round the committed context grows by
3 target tokens, and the drafter brings its view of the text up to date
(``CrossVocabDrafter._sync``: the text in the drafter's tokens) and then learns from the
commit (``learn``, which syncs first). Medians of 10 rounds per length. No model call is
timed. To compare with another checkout, run it again with ``PYTHONPATH`` pointing at a
folder whose ``tandem`` links to that checkout.

Run: ``python -m benchmarks.xvocab_sync --models ~/.cache/tandem-real-models 1000 4000 16000``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from benchmarks.long_chat import WORDS
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_config import LlamaConfig
from tandem.runtime.speculative.drafters.xvocab.drafter import CrossVocabDrafter, XVocabConfig


def per_round(step, ids: list[int], n: int, rounds: int = 10) -> list[float]:
    step(ids[:n])
    times = []
    for r in range(rounds):
        start = time.perf_counter()
        step(ids[: n + 3 * (r + 1)])
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=Path, default=Path.home() / ".cache" / "tandem-real-models")
    ap.add_argument("lengths", nargs="+", type=int)
    args = ap.parse_args()
    target = LlamaCppBackend(args.models / "qwen2.5-coder-1.5b.gguf", LlamaConfig(n_ctx=512, n_threads=2))
    drafter = LlamaCppBackend(args.models / "smollm2-135m-instruct.gguf", LlamaConfig(n_ctx=512, n_threads=2))
    rng = random.Random(0)
    ids = target.tokenize(" ".join(rng.choice(WORDS) for _ in range(4 * max(args.lengths))))
    try:
        for n in args.lengths:
            xv = CrossVocabDrafter(drafter, target, XVocabConfig(persist=False), owns_backend=False)
            sync = per_round(xv._sync, ids, n)
            xv = CrossVocabDrafter(drafter, target, XVocabConfig(persist=False), owns_backend=False)
            learn = per_round(xv.learn, ids, n)
            print(f"{n:6d} tokens: sync {statistics.median(sync) * 1e3:.1f} ms a round "
                  f"({min(sync) * 1e3:.1f}-{max(sync) * 1e3:.1f}), learn (with its sync) "
                  f"{statistics.median(learn) * 1e3:.1f} ms ({min(learn) * 1e3:.1f}-{max(learn) * 1e3:.1f})",
                  flush=True)
    finally:
        drafter.close()
        target.close()


if __name__ == "__main__":
    main()
