"""What speculation cost each reply of a `tandem bench` run, priced instead of timed.

On a box whose speed drifts more between replies than speculation can gain or lose, the
wall-clock ratios cannot show a 3 % cost. Each reply's record says what it asked of the
target: ``target_calls`` verify calls, ``drafted`` tokens drafted in them. With the
machine's verify-cost curve c(k) (one call over k + 1 tokens, in one-token steps), a
call verifying k drafts costs at most ``1 + slope * k`` steps, where ``slope`` is the
largest ``(c(k) - 1) / k``; so a reply of ``n`` tokens runs at no less than
``n / (target_calls + slope * drafted)`` of plain decoding's ``n`` steps. A drafter
model's own drafting time is not in that price (its configuration is marked).

Run from the repository root:
``python -m benchmarks.priced_replies FIGURES.json --curve 1,1.72,1.84,2.93,3.17 -n 64``
(the curve as ``tandem run --json`` shows it under ``cost_curve``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence


def slope(curve: Sequence[float]) -> float:
    """The largest extra cost per draft, ``max (c(k) - 1) / k`` over the curve."""
    return max((c - 1.0) / k for k, c in enumerate(curve) if k > 0)


def priced(runs: list[dict], curve: Sequence[float], tokens: int) -> dict[str, list[float]]:
    """Each speculative configuration's replies, priced against plain decoding."""
    per_draft = slope(curve)
    out: dict[str, list[float]] = {}
    for run in runs:
        if run["config"] in ("plain", "llama", "llama-lookup"):
            continue
        out.setdefault(run["config"], []).append(tokens / (run["target_calls"] + per_draft * run["drafted"]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("figures", help="a `tandem bench --json` file")
    parser.add_argument("--curve", required=True, help="c(0), c(1), ... comma-separated")
    parser.add_argument("-n", type=int, default=64, help="tokens a reply (the bench's -n)")
    args = parser.parse_args()
    curve = [float(c) for c in args.curve.split(",")]
    with open(args.figures) as fh:
        runs = json.load(fh)["runs"]
    print(f"a verify of k drafts costs at most 1 + {slope(curve):.3f} k steps")
    print("| configuration | priced against plain, min-max (median) |\n|---|---|")
    for config, ratios in priced(runs, curve, args.n).items():
        with_model = "model" in config or "xvocab" in config
        note = "; a drafter model's own time, where it drafted, is not in the price" if with_model else ""
        print(f"| `{config}` | {min(ratios):.3f}-{max(ratios):.3f} ({statistics.median(ratios):.3f}){note} |")


if __name__ == "__main__":
    main()
