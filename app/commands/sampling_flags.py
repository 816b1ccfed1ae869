"""The sampling flags of `run` and `chat` (``--temp --top-k ... --seed --stop``), their
ranges, and the :class:`~tandem.kernels.sampling_params.SamplingParams` they describe."""

from __future__ import annotations

import argparse
import math

from tandem.errors import TandemError
from tandem.kernels.sampling_params import SamplingParams


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temp", type=float, default=0.0, help="temperature; 0 is greedy (default)")
    g.add_argument("--top-k", type=int, default=40)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--min-p", type=float, default=0.05)
    g.add_argument("--repeat-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--repeat-last-n", type=int, default=64,
                   help="latest tokens the penalties look at (default 64; 0: all)")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


SAMPLING_RANGES: dict[str, tuple[float, float, str]] = {
    "temp": (0.0, math.inf, "0 or more (0: greedy)"),
    "top_k": (0, math.inf, "0 or more (0: off)"),
    "top_p": (0.0, 1.0, "between 0 and 1"),
    "min_p": (0.0, 1.0, "between 0 and 1"),
    "repeat_penalty": (1e-9, math.inf, "above 0 (1: off)"),
    "presence_penalty": (-math.inf, math.inf, "a number"),
    "frequency_penalty": (-math.inf, math.inf, "a number"),
    "repeat_last_n": (-1, math.inf, "-1 or more (0 and -1: all)"),
}
"""Each sampling flag's range: a value outside it is one error line (``--temp nan`` printed
numpy warnings and an empty reply, ``--repeat-penalty 0`` divided by zero)."""


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    for name, (low, high, what) in SAMPLING_RANGES.items():
        value = vars(args)[name]
        if not math.isfinite(value) or not low <= value <= high:
            raise TandemError(f"--{name.replace('_', '-')} must be {what}, got {value}.")
    return SamplingParams(
        temperature=args.temp,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repeat_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repeat_last_n=max(0, args.repeat_last_n),
        seed=None if args.seed is None or args.seed < 0 else args.seed,  # -1: a random seed, as in llama.cpp
    )
