"""Start-up: `tandem run` against llama-cpp-python loading the same file and generating
the same tokens with the same threads, as whole processes timed from start to exit.

Arms, run in turn round after round (the order rotated each round, so the load of a
shared machine hits all alike), medians with the range:

- ``peer``: ``llama_cpp.Llama(model, n_threads=T)`` (its defaults otherwise), then
  ``create_completion(prompt, max_tokens=N, temperature=0)``;
- ``tandem``: ``tandem run -m model -p prompt -n N --threads T --raw -q --suffix-memory
  request`` with a data folder (``TANDEM_HOME``) that has seen this model before;
- ``tandem+draft`` (``--draft``): the same with a drafter model;
- ``first`` (``--first``): ``tandem run`` (with the drafter when given) in a fresh data
  folder each time, against ``tandem`` again in that folder right after: what a fresh
  install's first run costs (this machine's baseline is measured then, once per machine);
- ``new pair`` (``--first``): the same in a fresh data folder that already holds this
  machine's process baseline: what a new model pair costs its first run;
- ``base`` (``--base DIR``): ``tandem run`` from another checkout of the code (an
  extracted older commit), to put before and after side by side (with ``--first``, its
  first runs and new pairs too).

Both generate greedily from the raw prompt; their texts are printed once so a reader can
see they produced the same tokens. Run from the repository root:
``python -m benchmarks.startup --model M --draft D --threads 2 --rounds 7 --first``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"

PEER = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_threads=int(sys.argv[2]), verbose=False)
out = llm.create_completion(sys.argv[3], max_tokens=int(sys.argv[4]), temperature=0.0)
sys.stdout.write(out["choices"][0]["text"])
"""


def tandem_cmd(model: str, n: int, threads: int, draft: str | None) -> list[str]:
    # --suffix-memory request: with the saved suffix tree (the default) a run would draft
    # its whole reply from the identical run before it, and a second run would be faster
    # than the first by generation, not by start-up.
    cmd = [str(Path(sys.executable).parent / "tandem"), "run", "-m", model, "-p", PROMPT, "-n", str(n),
           "--threads", str(threads), "--raw", "-q", "--suffix-memory", "request"]
    return cmd + (["--draft", draft] if draft else [])


CPU: dict[str, list[float]] = {}
"""CPU seconds (user + system, the process and its children) per arm: on a machine
shared with other work, wall time waits for cores and CPU time much less."""


def timed(cmd: list[str], env: dict[str, str], arm: str = "") -> tuple[float, str]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:3])} failed:\n{proc.stderr[-2000:]}")
    if arm:
        CPU.setdefault(arm, []).append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return wall, proc.stdout.strip()


def summary(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} s ({min(xs):.2f}-{max(xs):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-n", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--first", action="store_true", help="also time a first run in a fresh data folder")
    ap.add_argument("--base", default=None, help="a checkout of another version of the code to time beside")
    ap.add_argument("--json", default=None, help="write the raw times here")
    args = ap.parse_args()

    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # as installed: bytecode cached
    env["HF_HUB_OFFLINE"] = "1"
    # The kernel probe a first run leaves in the background would slow the runs after it:
    # off here, so every arm times the weights as stored (benchmarks/kernels.py times both).
    env["TANDEM_KERNEL_PROBE"] = "off"
    home = tempfile.mkdtemp(prefix="tandem-startup-")
    arms: dict[str, tuple[list[str], dict[str, str]]] = {
        "peer": ([sys.executable, "-c", PEER, args.model, str(args.threads), PROMPT, str(args.n)], env),
        "tandem": (tandem_cmd(args.model, args.n, args.threads, None), {**env, "TANDEM_HOME": home}),
    }
    if args.draft:
        arms["tandem+draft"] = (tandem_cmd(args.model, args.n, args.threads, args.draft),
                                {**env, "TANDEM_HOME": home})
    if args.base:
        shim = Path(tempfile.mkdtemp(prefix="tandem-base-"))
        (shim / "tandem").symlink_to(Path(args.base).resolve())
        base_home = tempfile.mkdtemp(prefix="tandem-startup-base-")
        arms["base"] = (tandem_cmd(args.model, args.n, args.threads, None),
                        {**env, "TANDEM_HOME": base_home, "PYTHONPATH": str(shim)})
        if args.draft:
            arms["base+draft"] = (tandem_cmd(args.model, args.n, args.threads, args.draft),
                                  {**env, "TANDEM_HOME": base_home, "PYTHONPATH": str(shim)})
    times: dict[str, list[float]] = {name: [] for name in arms}
    texts: dict[str, str] = {}
    for name, (cmd, arm_env) in arms.items():  # warm-up: page cache, bytecode, per-machine caches
        texts[name] = timed(cmd, arm_env)[1]
    first_arms = {}
    if args.first:
        first_arms = {"first": [], "second": [], "new pair": [], "pair second": []}
        base_first = ({"base first": [], "base second": [], "base new pair": [], "base pair second": []}
                      if args.base else {})
        first_arms.update(base_first)
    names = list(arms)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            cmd, arm_env = arms[name]
            times[name].append(timed(cmd, arm_env, name)[0])
        if args.first:
            for prefix, arm in (("", "tandem+draft" if args.draft else "tandem"),
                                *((("base ", "base+draft" if args.draft else "base"),) if args.base else ())):
                fresh = tempfile.mkdtemp(prefix="tandem-first-")
                cmd, arm_env = arms[arm]
                first_arms[prefix + "first"].append(timed(cmd, {**arm_env, "TANDEM_HOME": fresh}, prefix + "first")[0])
                first_arms[prefix + "second"].append(
                    timed(cmd, {**arm_env, "TANDEM_HOME": fresh}, prefix + "second")[0])
                shutil.rmtree(fresh, ignore_errors=True)
            # A new pair on a machine Tandem knows: only the per-machine baseline is kept.
            for prefix, arm, known in (("", "tandem", home), *((("base ", "base", base_home),) if args.base else ())):
                fresh = tempfile.mkdtemp(prefix="tandem-pair-")
                shutil.copytree(Path(known) / "cache" / "machine-baseline", Path(fresh) / "cache" / "machine-baseline")
                cmd, arm_env = arms[arm + "+draft" if args.draft else arm]
                for name in ("new pair", "pair second"):
                    first_arms[prefix + name].append(timed(cmd, {**arm_env, "TANDEM_HOME": fresh}, prefix + name)[0])
                shutil.rmtree(fresh, ignore_errors=True)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in {**times, **first_arms}.items()),
              file=sys.stderr)
    shutil.rmtree(home, ignore_errors=True)
    print(f"model {Path(args.model).name}, drafter {Path(args.draft).name if args.draft else '-'}, "
          f"{args.threads} threads, {args.n} tokens, {args.rounds} rounds; load: {os.getloadavg()[0]:.2f}")
    print("  wall seconds, then CPU seconds (user + system); the difference to the peer is per round")
    for name, xs in {**times, **first_arms}.items():
        extra = ""
        if name != "peer":
            diff = [a - b for a, b in zip(xs, times["peer"], strict=False)]
            cpu = [a - b for a, b in zip(CPU[name], CPU["peer"], strict=False)]
            extra = f"   minus peer: {statistics.median(diff):+.2f} s wall, {statistics.median(cpu):+.2f} s CPU"
        print(f"  {name:14s} {summary(xs)}   CPU {summary(CPU[name])}{extra}")
    if args.first:
        prefixes = ("", "base ") if args.base else ("",)
        pairs = [(f"{p}{first}", f"{p}{second}") for first, second in (("first", "second"), ("new pair", "pair second"))
                 for p in prefixes]
        for first, second in pairs:
            extra = [a - b for a, b in zip(first_arms[first], first_arms[second], strict=True)]
            cpu = [a - b for a, b in zip(CPU[first], CPU[second], strict=True)]
            print(f"  {first} run over the second: {statistics.median(extra):+.2f} s wall "
                  f"({min(extra):+.2f} to {max(extra):+.2f}), {statistics.median(cpu):+.2f} s CPU")
    print("texts: " + json.dumps(texts))
    if args.json:
        Path(args.json).write_text(json.dumps({"times": times, **first_arms, "cpu": CPU, "texts": texts}, indent=1))


if __name__ == "__main__":
    main()
