"""`tandem twin`: build a cost twin (a widened model computing the same function), and measure it.

The measurement helpers here are what the twin tests and BENCHMARKS.md use: greedy
agreement of a twin with its source (exact runs, common-prefix length, and
teacher-forced top-1 agreement) and plain one-token-at-a-time decoding speed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tandem.app.progress import Progress
from tandem.models.quantize import FILE_TYPES
from tandem.models.twin import build_twin, params_label
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_config import LlamaConfig
from tandem.runtime.backends.protocol import Backend

PROMPTS = ("Once upon a time", "The little dog", "Lily and Tom went to the park. They", "One day, a big")


@dataclass(frozen=True)
class Agreement:
    """How closely ``b`` follows ``a``'s greedy output over a set of prompts."""

    prompts: int
    exact: int
    """prompts whose whole greedy continuation is identical"""
    prefix: float
    """mean fraction of the continuation before the first difference"""
    teacher_forced: float
    """fraction of positions where b's argmax equals a's token, fed a's continuation"""

    def __str__(self) -> str:
        return (f"exact {self.exact}/{self.prompts}, common prefix {self.prefix:.0%}, "
                f"teacher-forced top-1 {self.teacher_forced:.1%}")


def greedy(backend: Backend, ids: Sequence[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``ids``, from an empty cache (no sampler, no stop)."""
    backend.truncate(0)
    out: list[int] = []
    logits = backend.evaluate(list(ids))[0]
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = backend.evaluate(out[-1:])[0]
    return out


def agreement(a: Backend, b: Backend, prompts: Sequence[Sequence[int]], n: int = 64) -> Agreement:
    exact = hits = total = 0
    prefixes = []
    for ids in prompts:
        ref, got = greedy(a, ids, n), greedy(b, ids, n)
        exact += ref == got
        prefixes.append(next((i for i, (x, y) in enumerate(zip(ref, got, strict=True)) if x != y), n) / n)
        b.truncate(0)
        rows = b.evaluate(list(ids) + ref[:-1], logits_for=range(len(ids) - 1, len(ids) + n - 1))
        hits += int((rows.argmax(axis=1) == ref).sum())
        total += n
    return Agreement(len(prompts), exact, statistics.fmean(prefixes), hits / total)


def decode_speed(backend: Backend, ids: Sequence[int], n: int = 64) -> float:
    """Tokens per second of plain greedy decoding (one token per evaluate), prefill excluded."""
    backend.truncate(0)
    logits = backend.evaluate(list(ids))[0]
    start = time.perf_counter()
    for _ in range(n):
        logits = backend.evaluate([int(logits.argmax())])[0]
    return n / (time.perf_counter() - start)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("twin", help="widen a Llama GGUF to a target size that computes the same function")
    p.add_argument("src", help="Llama GGUF to widen (e.g. a converted tinystories-656k)")
    p.add_argument("-o", "--output", required=True, help="GGUF file to write")
    p.add_argument("--params", required=True, help="target parameter count, e.g. 300M or 1B")
    p.add_argument("--type", default="f32", choices=list(FILE_TYPES), help="tensor type (default f32)")
    p.add_argument("--verify", type=int, default=0, metavar="N",
                   help="afterwards, compare N greedy tokens with the source and time decoding")
    p.add_argument("--threads", type=int, default=None, help="threads for --verify")
    p.add_argument("--reuse", action="store_true", help="keep OUTPUT if it exists (only --verify it)")
    p.add_argument("--repeats", type=int, default=3, help="decoding-speed runs for --verify (median)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    out = Path(args.output)
    if args.reuse and out.is_file():
        print(f"reusing {out} ({out.stat().st_size / 2**20:.1f} MiB)")
    else:
        with Progress(f"writing a {args.params} twin of {Path(args.src).name}"):
            report = build_twin(args.src, out, args.params, args.type)
        s = report.shape
        print(f"wrote {report.path} ({report.file_bytes / 2**20:.1f} MiB) in {report.seconds:.1f} s: "
              f"{params_label(s.count_params())} parameters ({s.count_params():,}), n_embd {s.n_embd}, "
              f"n_ff {s.n_ff}, {s.n_layer} layers, {s.n_head} heads / {s.n_head_kv} KV heads of {s.head_dim}")
    if args.verify:
        verify(Path(args.src), out, args.verify, args.threads, args.repeats)
    return 0


def verify(src: Path, twin: Path, n: int, threads: int | None = None, repeats: int = 3) -> Agreement:
    """Print greedy agreement with the source and the median decoding speed of both.

    Speed runs alternate source and twin so background load hits both alike.
    """
    cfg = LlamaConfig(n_ctx=max(256, 2 * n), n_threads=threads)
    with LlamaCppBackend(src, cfg) as a, LlamaCppBackend(twin, cfg) as b:
        prompts = [a.tokenize(p, add_bos=True) for p in PROMPTS]
        result = agreement(a, b, prompts, n)
        print(f"greedy agreement with {src.name} over {n} tokens: {result}")
        speeds: dict[str, list[float]] = {"source": [], "twin": []}
        for _ in range(max(1, repeats)):
            speeds["source"].append(decode_speed(a, prompts[0], n))
            speeds["twin"].append(decode_speed(b, prompts[0], n))
        print(f"plain decoding, median of {len(speeds['twin'])}: "
              f"source {statistics.median(speeds['source']):.1f} tok/s, "
              f"twin {statistics.median(speeds['twin']):.1f} tok/s")
    return result
