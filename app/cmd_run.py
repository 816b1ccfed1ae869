"""`tandem run`: generate from a prompt, streaming text or printing one JSON object."""

from __future__ import annotations

import argparse
import json
import sys

from tandem.kernels.sampling import Sampler, SamplingParams
from tandem.models.store import resolve_model
from tandem.runtime.generate import DoneEvent, generate
from tandem.runtime.llama_backend import LlamaConfig, LlamaCppBackend


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temp", type=float, default=0.0, help="temperature; 0 is greedy (default)")
    g.add_argument("--top-k", type=int, default=40)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--min-p", type=float, default=0.05)
    g.add_argument("--repeat-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temp,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repeat_penalty,
        seed=args.seed,
    )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="generate text from a prompt")
    p.add_argument("-m", "--model", required=True, help="GGUF file or a name from `tandem models`")
    p.add_argument("-p", "--prompt", default=None, help="prompt text (default: read standard input)")
    p.add_argument("-n", "--max-tokens", type=int, default=128)
    p.add_argument("--ctx", type=int, default=None, help="context length (default: the model's, ≤ 4096)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object with text, ids and stats")
    add_sampling_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    path = resolve_model(args.model)
    with LlamaCppBackend(path, LlamaConfig(n_ctx=args.ctx, n_threads=args.threads)) as target:
        ids = target.tokenize(prompt, add_bos=True) if prompt else []
        if target.special.bos is not None and ids == [target.special.bos]:
            ids = []  # a prompt of only BOS is an empty prompt
        sampler = Sampler(sampling_from_args(args))
        for event in generate(target, ids, sampler, max_tokens=args.max_tokens, stop=args.stop):
            if isinstance(event, DoneEvent):
                if args.json:
                    out = {"model": target.name, "prompt": prompt, "text": event.text,
                           "token_ids": event.tokens, "stats": event.stats.as_dict()}
                    print(json.dumps(out))
                else:
                    print(flush=True)
            elif not args.json:
                sys.stdout.write(event.text)
                sys.stdout.flush()
    return 0
