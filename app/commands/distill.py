"""`tandem distill`: train a tiny same-vocabulary drafter for a GGUF target."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from tandem.app.progress import Progress
from tandem.errors import TandemError
from tandem.models.extras import require
from tandem.models.store import resolve_model


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "distill",
        help="train a tiny drafter with the target's vocabulary on text the target writes",
        description="Generate sampled stories with TARGET, train a tiny Llama with its tokenizer "
        "on them (CPU, minutes), and write it as a GGUF drafter for --draft.",
    )
    p.add_argument("target", help="target GGUF file or a name from `tandem models`")
    p.add_argument("-o", "--output", required=True, type=Path, help="drafter GGUF to write")
    p.add_argument("--stories", type=int, default=400, help="stories to generate (default 400)")
    p.add_argument("--story-tokens", type=int, default=160)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=192)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--seconds", type=float, default=240.0, help="training time cap (default 240)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    require("tandem distill", "torch", "torch")
    # Trains in torch (imported at the distiller's module level): imported after the check.
    from tandem.runtime.speculative.drafters.distill import DistillConfig, distill

    for name in ("stories", "story_tokens", "dim", "layers", "heads", "ffn"):
        if getattr(args, name) < 1:
            raise TandemError(f"--{name.replace('_', '-')} must be at least 1.")
    if args.steps < 0:
        raise TandemError("--steps must not be negative.")
    cfg = DistillConfig(stories=args.stories, story_tokens=args.story_tokens, n_embd=args.dim, n_layer=args.layers,
                        n_head=args.heads, n_ff=args.ffn, steps=args.steps, seconds=args.seconds, seed=args.seed)
    with Progress(f"distilling a drafter from {Path(args.target).name}") as progress:
        report = distill(resolve_model(args.target), args.output, cfg, on_step=progress.step)
    if args.json:
        print(json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in asdict(report).items()}))
    else:
        print(f"wrote {report.out}: {report.corpus_tokens} corpus tokens ({report.gen_s:.1f}s), "
              f"{report.steps} steps ({report.train_s:.1f}s), loss {report.loss_first:.3f} -> {report.loss_last:.3f}")
    return 0
