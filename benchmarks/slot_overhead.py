"""Parallel slots without the server: aggregate decode rate of 1 against N slots of one
context, and the host's share of each step (everything but ``llama_decode``).

N threads each decode a greedy reply on their own slot (:mod:`tandem.runtime.backends.llama_batch`),
as the server's slots do, with the batcher gathering their steps into shared decodes.
``llama_decode`` is timed apart, so what is left of the wall time is the host's work per
step: each slot's sampling and bookkeeping over the vocabulary's logits row, the batcher
building the batch and copying rows out, and the threads' hand-offs. On a CPU that is a
few percent of a step; on a GPU, whose 4-row step of the 0.5B takes about 2 ms, it decides
how far N slots get towards their ceiling N / c(N) (BENCHMARKS "Parallel slots").
Plain decoding's speed does not depend on what the weights are, so the GPU kit's
random-weight models of the real shapes give real figures here. ``--speculative``: each
slot drafts model-free (suffix tree and prompt lookup, adaptive lengths), as `tandem
serve` runs a slot without a drafter model; the host then also pays each round's drafting
and pricing (how much speculation gains depends on the weights, so on random ones only the
host's time is meaningful).

    python -m benchmarks.slot_overhead MODEL.gguf [--slots 4] [--tokens 64] [--rounds 2] [--threads T] [--ngl -1]
        [--speculative]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from dataclasses import dataclass, field

from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_batch import SequenceBatcher
from tandem.runtime.backends.llama_config import LlamaConfig
from tandem.runtime.backends.sequence_view import open_views
from tandem.runtime.generate import DoneEvent, autoregressive, generate
from tandem.runtime.speculative.factory import SpecOptions, build_strategy

PROMPTS = ("def fibonacci(n):", "The capital of France is", "import numpy as np\n", "Once upon a time",
           "SELECT name FROM users WHERE", "class Stack:\n", "// parse a config file\n", "Dear team,")


@dataclass
class SlotRun:
    slots: int
    tokens: int
    wall_s: float
    decode_s: float
    decodes: int
    replies: list[list[int]] = field(default_factory=list, repr=False)
    """Each slot's tokens (greedy: the same with or without drafting)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def host_ms_per_decode(self) -> float:
        return (self.wall_s - self.decode_s) / self.decodes * 1e3


def run_slots(batcher: SequenceBatcher, slots: int, tokens: int, speculative: bool = False) -> SlotRun:
    """``slots`` greedy replies of ``tokens`` tokens at once, one per slot of ``batcher``
    (from the first), plain or (``speculative``) drafted model-free; their prompts are
    prefilled first, so only decoding is timed."""
    base = batcher.base
    decode_s = [0.0]
    decode = base.decode_batch

    def timed(batch) -> int:
        start = time.perf_counter()
        try:
            return decode(batch)
        finally:
            decode_s[0] += time.perf_counter() - start

    base.decode_batch = timed  # type: ignore[method-assign]
    replies: list[DoneEvent | None] = [None] * slots
    ready = threading.Barrier(slots + 1)
    go = threading.Event()

    errors: list[BaseException] = []

    def reply(i: int) -> None:
        view = batcher.views[i]
        try:
            view.truncate(0)
            ids = view.tokenize(PROMPTS[i % len(PROMPTS)], add_bos=True)
            view.evaluate(ids[:-1])  # the prompt, before the clock starts
            strategy = (build_strategy(view, None, SpecOptions(mode="ngram", measure_cost=False,
                                                               suffix_memory="request")) if speculative else None)
            ready.wait()
            go.wait()
            with view.engaged():
                for ev in generate(view, ids, Sampler(SamplingParams(temperature=0.0)), max_tokens=tokens,
                                   stop_at_eog=False, strategy=strategy or autoregressive):
                    if isinstance(ev, DoneEvent):
                        replies[i] = ev
            if strategy is not None:
                strategy.close()
        except BaseException as exc:
            errors.append(exc)
            ready.abort()

    threads = [threading.Thread(target=reply, args=(i,)) for i in range(slots)]
    try:
        for t in threads:
            t.start()
        try:
            ready.wait()
        except threading.BrokenBarrierError:
            go.set()
        decode_s[0], decodes0 = 0.0, batcher.stats.decodes
        start = time.perf_counter()
        go.set()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
    finally:
        del base.decode_batch
    if errors:
        raise errors[0]
    done = [r for r in replies if r is not None]
    return SlotRun(slots, sum(len(r.tokens) for r in done), wall, decode_s[0], batcher.stats.decodes - decodes0,
                   [list(r.tokens) for r in done])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--ngl", type=int, default=0, help="llama.cpp GPU layers (-1: all)")
    ap.add_argument("--speculative", action="store_true", help="each slot drafts model-free")
    args = ap.parse_args()
    base = LlamaCppBackend(args.model, LlamaConfig(n_ctx=256 * args.slots, n_threads=args.threads,
                                                   n_gpu_layers=args.ngl, n_seq=args.slots))
    batcher = open_views(base)
    try:
        runs: dict[int, list[SlotRun]] = {1: [], args.slots: []}
        run_slots(batcher, args.slots, 8, args.speculative)  # warm-up: the first decodes of each shape
        for _ in range(args.rounds):
            for n in runs:  # alternating, so load drift hits both alike
                r = run_slots(batcher, n, args.tokens, args.speculative)
                runs[n].append(r)
                print(json.dumps({"slots": r.slots, "tokens": r.tokens, "wall_s": round(r.wall_s, 4),
                                  "decode_s": round(r.decode_s, 4), "decodes": r.decodes,
                                  "tokens_per_s": round(r.tokens_per_s, 2),
                                  "host_ms_per_decode": round(r.host_ms_per_decode, 3)}), flush=True)
    finally:
        batcher.close()
        base.close()
    one, many = (statistics.median(r.tokens_per_s for r in runs[n]) for n in (1, args.slots))
    host = {n: statistics.median(r.host_ms_per_decode for r in rs) for n, rs in runs.items()}
    print(f"1 slot {one:.1f} tok/s, {args.slots} slots {many:.1f} tok/s: {many / one:.2f}x aggregate; host per "
          f"decode {host[1]:.2f} ms alone, {host[args.slots]:.2f} ms with {args.slots} slots")


if __name__ == "__main__":
    main()
