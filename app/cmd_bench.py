"""`tandem bench`: speed benchmarks that run baseline and candidate alternately in one process.

Default: plain decoding vs each speculative mode. ``--autocomplete``: k superposed drafts
vs k sampled runs vs one k-sequence batch. ``--ar-overhead``: Tandem's plain decoding loop
vs llama-cpp-python's own ``Llama.generate``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tandem.models.errors import TandemError
from tandem.models.store import resolve_model


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("draft lengths must be positive integers")
    return values


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="speed benchmarks, baseline vs candidate in one run (speculative, --autocomplete, --ar-overhead)")
    p.add_argument("-m", "--model", required=True, help="target GGUF file or store name")
    p.add_argument("--draft", default=None, help="drafter model (same or other vocabulary)")
    p.add_argument("--oracle", default=None,
                   help="oracle drafter: the model the target is a cost twin of (shows the ceiling)")
    p.add_argument("-n", "--max-tokens", type=int, default=64, help="tokens generated per run")
    p.add_argument("--prompts", type=int, default=2, help="prompts per workload")
    p.add_argument("--reps", type=int, default=1, help="repetitions (configurations alternate within each)")
    p.add_argument("--lengths", type=_ints, default=(1, 2, 3, 4, 5, 6, 7, 8), help="fixed draft lengths, e.g. 1,2,4,8")
    p.add_argument("--drafters", type=_names, default=("ngram", "suffix", "lookup", "model", "oracle"),
                   help="drafters swept at fixed lengths (ngram,suffix,lookup,model,oracle)")
    p.add_argument("--workloads", type=_names, default=("story", "random", "repetitive"))
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--ctx", type=int, default=None, help="context size (default: the model's)")
    p.add_argument("--no-llama-baseline", action="store_true", help="skip llama-cpp-python's prompt lookup")
    p.add_argument("--json", dest="json_file", default=None, metavar="FILE", help="write the figures as JSON")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="draw the figures (PNG)")
    modes = p.add_mutually_exclusive_group()
    modes.add_argument("--autocomplete", action="store_true",
                       help="k autocomplete drafts: superposed vs k sampled runs vs one k-sequence batch")
    modes.add_argument("--ar-overhead", action="store_true",
                       help="Tandem's plain decoding vs llama-cpp-python's Llama.generate")
    p.add_argument("--k", type=_ints, default=(2, 3, 5), help="with --autocomplete: draft counts (default 2,3,5)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.autocomplete:
        return run_autocomplete(args)
    if args.ar_overhead:
        return run_ar_overhead(args)
    from tandem.runtime.bench import WORKLOADS, BenchConfig, format_report, plot_report, run_bench

    bad = [w for w in args.workloads if w not in WORKLOADS]
    if bad:
        raise TandemError(f"Unknown workload {bad[0]!r}; choose from {', '.join(WORKLOADS)}.")
    if args.max_tokens < 2 or args.prompts < 1 or args.reps < 1:
        raise TandemError("--max-tokens must be at least 2, --prompts and --reps at least 1.")
    cfg = BenchConfig(
        target=resolve_model(args.model),
        draft=resolve_model(args.draft) if args.draft else None,
        oracle=resolve_model(args.oracle) if args.oracle else None,
        n_tokens=args.max_tokens, prompts=args.prompts, reps=args.reps, lengths=args.lengths,
        drafters=args.drafters, workloads=args.workloads, threads=args.threads, ctx=args.ctx,
        llama_baseline=not args.no_llama_baseline,
        log=lambda line: print(line, flush=True),
    )
    report = run_bench(cfg)
    print(format_report(report))
    if args.json_file:
        Path(args.json_file).write_text(json.dumps(report, indent=1))
    if args.plot:
        plot_report(report, args.plot)
    return 0


def run_autocomplete(args: argparse.Namespace) -> int:
    from tandem.runtime.bench_autocomplete import PROMPTS, markdown_table, run_bench
    from tandem.runtime.llama_backend import LlamaConfig, LlamaCppBackend

    if max(args.k) > 16:
        raise TandemError("--k values must be between 1 and 16.")
    if args.max_tokens < 1 or args.reps < 1 or not 1 <= args.prompts <= len(PROMPTS):
        raise TandemError(f"--max-tokens and --reps must be at least 1, --prompts 1..{len(PROMPTS)}.")
    config = LlamaConfig(n_ctx=args.ctx or 256, n_threads=args.threads)
    with LlamaCppBackend(resolve_model(args.model), config) as target:
        result = run_bench(target, sorted(set(args.k)), args.max_tokens, args.reps, PROMPTS[: args.prompts],
                           log=lambda s: print(s, file=sys.stderr, flush=True))
    print(f"model {result['model']}, {result['max_tokens']} tokens per draft, medians of "
          f"{result['repeats']} x {result['prompts']} prompts")
    print(markdown_table(result))
    if args.json_file:
        Path(args.json_file).write_text(json.dumps(result, indent=1))
    return 0


def run_ar_overhead(args: argparse.Namespace) -> int:
    from tandem.runtime.bench_ar import measure_overhead

    result = measure_overhead(resolve_model(args.model), tokens=args.max_tokens, rounds=args.reps,
                              threads=args.threads)
    print(f"{result.model}: Tandem {result.tandem_tps:.2f} tok/s, llama-cpp-python {result.llama_tps:.2f} tok/s, "
          f"ratio {result.ratio:.3f} (median of per-pair ratios), identical greedy output: {result.identical}")
    if args.json_file:
        Path(args.json_file).write_text(json.dumps(result.as_dict(), indent=1))
    return 0
