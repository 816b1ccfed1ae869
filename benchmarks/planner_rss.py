"""The planner's promise, measured: `tandem plan --json` against `tandem run`'s peak RSS.

For each case (target, optional drafter, context) it runs, each in a fresh process as a
user would: `tandem plan ... --json` (the predicted peak resident memory,
``memory.host_total_bytes``) and `tandem run` with the same settings, a code prompt
filling ~75 % of the context and a few greedy tokens, whose peak resident memory is
read from ``wait4`` (``ru_maxrss``: what ``/usr/bin/time -f %M`` prints). Prints a
Markdown table (predicted, measured, error).

    python -m benchmarks.planner_rss --models ~/.cache/tandem-real-models \\
        qwen2.5-coder-1.5b:2048 qwen2.5-coder-1.5b:2048:qwen2.5-coder-0.5b smollm2-135m-instruct:512
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

FILL = 0.75
TOKENS_PER_WORD = 18
"""Tokens of one ``def fN(x): return x * N + N`` line (Qwen2.5 and SmolLM2 tokenizers)."""


@dataclass(frozen=True)
class Case:
    target: str
    ctx: int
    draft: str | None = None

    @classmethod
    def parse(cls, spec: str) -> Case:
        parts = spec.split(":")
        return cls(parts[0], int(parts[1]), parts[2] if len(parts) > 2 and parts[2] else None)


def code_prompt(tokens: int) -> str:
    return "".join(f"def f{i}(x):\n    return x * {i} + {i}\n" for i in range(max(1, tokens // TOKENS_PER_WORD)))


def peak_rss(argv: list[str], stdin: str) -> int:
    """Run ``argv`` and return its peak resident bytes (``ru_maxrss`` from ``wait4``)."""
    with tempfile.TemporaryFile("w+") as inp, tempfile.TemporaryFile("w+") as err:
        inp.write(stdin)
        inp.seek(0)
        proc = subprocess.Popen(argv, stdin=inp, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode:
            err.seek(0)
            raise RuntimeError(f"{' '.join(argv)} failed: {err.read()[-1000:]}")
    return usage.ru_maxrss * 1024


def measure(case: Case, models: Path, threads: int) -> dict:
    args = ["-m", str(models / f"{case.target}.gguf"), "--ctx", str(case.ctx), "--budget", "64GiB"]
    if case.draft:
        args += ["--draft", str(models / f"{case.draft}.gguf")]
    cli = [sys.executable, "-m", "tandem.app.cli"]
    plan = json.loads(subprocess.run([*cli, "plan", *args, "--json"], capture_output=True, text=True,
                                     check=True).stdout)
    measured = peak_rss([*cli, "run", *args, "--raw", "-n", "4", "--temp", "0", "--threads", str(threads)],
                        code_prompt(int(case.ctx * FILL)))
    predicted = plan["memory"]["host_total_bytes"]
    return {"case": case, "predicted": predicted, "measured": measured, "baseline": plan["memory"]["baseline_bytes"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cases", nargs="+", help="TARGET:CTX[:DRAFTER] (file stems in --models)")
    ap.add_argument("--models", type=Path, default=Path.home() / ".cache" / "tandem-real-models")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    print("| target | drafter | ctx | predicted (MiB) | measured peak RSS (MiB) | error |")
    print("|---|---|---:|---:|---:|---:|")
    for spec in args.cases:
        r = measure(Case.parse(spec), args.models, args.threads)
        c = r["case"]
        print(f"| {c.target} | {c.draft or '-'} | {c.ctx} | {r['predicted'] / 2**20:.1f} | "
              f"{r['measured'] / 2**20:.1f} | {r['predicted'] / r['measured'] - 1:+.1%} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
