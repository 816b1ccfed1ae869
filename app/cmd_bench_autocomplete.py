"""`tandem bench-autocomplete`: superposed drafts vs k sampled runs vs one k-sequence batch.

The logic lives in :mod:`tandem.runtime.bench_autocomplete`; when ``tandem bench``
exists this becomes its ``--autocomplete`` mode.
"""

from __future__ import annotations

import argparse
import json
import sys

from tandem.models.errors import TandemError
from tandem.models.store import resolve_model


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench-autocomplete",
                       help="benchmark k autocomplete drafts: superposed vs sequential vs batched")
    add_args(p)
    p.set_defaults(func=run)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", required=True, help="target GGUF (a cost twin, e.g. from `tandem twin`)")
    p.add_argument("--k", default="2,3,5", help="draft counts, comma-separated (default 2,3,5)")
    p.add_argument("-n", "--max-tokens", type=int, default=16, help="tokens per draft (default 16)")
    p.add_argument("--repeats", type=int, default=3, help="rounds over all prompts (default 3)")
    p.add_argument("--prompts", type=int, default=4, help="how many of the built-in prompts (1-4, default 4)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print the full result as JSON")


def run(args: argparse.Namespace) -> int:
    from tandem.runtime.bench_autocomplete import PROMPTS, markdown_table, run_bench
    from tandem.runtime.llama_backend import LlamaConfig, LlamaCppBackend

    try:
        ks = sorted({int(x) for x in args.k.split(",") if x.strip()})
    except ValueError:
        raise TandemError(f"--k takes comma-separated integers, got {args.k!r}.") from None
    if not ks or min(ks) < 1 or max(ks) > 16:
        raise TandemError("--k values must be between 1 and 16.")
    if args.max_tokens < 1 or args.repeats < 1 or not 1 <= args.prompts <= len(PROMPTS):
        raise TandemError(f"--max-tokens and --repeats must be at least 1, --prompts 1..{len(PROMPTS)}.")
    with LlamaCppBackend(resolve_model(args.model), LlamaConfig(n_ctx=256, n_threads=args.threads)) as target:
        result = run_bench(target, ks, args.max_tokens, args.repeats, PROMPTS[: args.prompts],
                           log=lambda s: print(s, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"model {result['model']}, {result['max_tokens']} tokens per draft, medians of "
              f"{result['repeats']} x {result['prompts']} prompts")
        print(markdown_table(result))
    return 0
