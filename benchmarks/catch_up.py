"""A model drafter's catch-up on the prompt, priced or not: whole replies against plain.

``auto`` next to a same-vocabulary drafter whose drafting is priced cheap (``--draft-cost``,
default 0.2 one-token target calls a drafted token: what the 0.5B cost next to the 1.5B
on the 2-vCPU Intel Xeon with the weights as stored, where its rounds paid), on the edit
and extract prompts of ``tandem bench``, 64 tokens each, a fresh strategy and suffix tree
per request. Each reply is timed whole (prompt included) and paired with plain decoding of
the same prompt in the same process; the greedy tokens must be identical. ``--base DIR``
runs the same in another checkout of the code, alternating with this one.

    python -m benchmarks.catch_up -m TARGET.gguf --draft DRAFTER.gguf --threads 2 --rounds 2 [--base OLD_CHECKOUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKLOADS = ("edit", "extract")


def one_process(args: argparse.Namespace) -> dict[str, list[float]]:
    """Time every prompt ``args.reps`` times in this process: {prompt: [plain s / auto s]}."""
    from tandem.app.bench.workloads import workload
    from tandem.kernels.sampling import Sampler
    from tandem.kernels.sampling_params import SamplingParams
    from tandem.runtime.backends.llama import LlamaCppBackend
    from tandem.runtime.backends.llama_config import LlamaConfig
    from tandem.runtime.generate import DoneEvent, generate
    from tandem.runtime.speculative.factory import SpecOptions, build_strategy

    config = LlamaConfig(n_ctx=1280, n_threads=args.threads)
    with LlamaCppBackend(Path(args.model), config) as target, LlamaCppBackend(Path(args.draft), config) as drafter:
        prompts = {f"{w}{i}": p for w in WORKLOADS for i, p in enumerate(workload(target, w, 3).prompts)}

        def reply(prompt: list[int], strategy=None) -> tuple[float, list[int]]:
            target.truncate(0)
            drafter.truncate(0)
            started = time.perf_counter()
            events = generate(target, prompt, Sampler(SamplingParams(temperature=0.0)), max_tokens=64,
                              stop_at_eog=False, **({"strategy": strategy} if strategy else {}))
            done = [e for e in events if isinstance(e, DoneEvent)][0]
            return time.perf_counter() - started, done.tokens

        reply(next(iter(prompts.values())))  # warm-up
        ratios: dict[str, list[float]] = {}
        for _ in range(args.reps):
            for name, prompt in prompts.items():
                plain_s, plain = reply(prompt)
                options = SpecOptions(mode="auto", draft_cost=args.draft_cost, measure_cost=False, suffix_memory="request")
                strategy = build_strategy(target, drafter, options)
                try:
                    auto_s, tokens = reply(prompt, strategy)
                finally:
                    strategy.close()
                if tokens != plain:
                    raise SystemExit(f"{name}: auto's greedy tokens differ from plain's")
                ratios.setdefault(name, []).append(plain_s / auto_s)
        return ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft-cost", type=float, default=0.2)
    ap.add_argument("--reps", type=int, default=2, help="repetitions of every prompt in one process")
    ap.add_argument("--rounds", type=int, default=2, help="processes per arm, alternating")
    ap.add_argument("--base", default=None, help="a checkout of another version of the code to time beside")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one_process(args)))
        return
    arms = {"this": dict(os.environ)}
    if args.base:
        shim = Path(tempfile.mkdtemp(prefix="tandem-base-"))
        (shim / "tandem").symlink_to(Path(args.base).resolve())
        arms["base"] = {**os.environ, "PYTHONPATH": str(shim)}
    child = [sys.executable, "-m", "benchmarks.catch_up", *sys.argv[1:], "--child"]
    results: dict[str, list[float]] = {arm: [] for arm in arms}
    for _ in range(args.rounds):
        for arm, env in arms.items():
            out = subprocess.run(child, env=env, capture_output=True, text=True, check=True).stdout
            ratios = json.loads(out.strip().splitlines()[-1])
            results[arm] += [r for rs in ratios.values() for r in rs]
    for arm, xs in results.items():
        print(f"{arm}: auto / plain, whole replies: median {statistics.median(xs):.2f} "
              f"({min(xs):.2f}-{max(xs):.2f}), {len(xs)} paired replies, greedy tokens identical")


if __name__ == "__main__":
    main()
