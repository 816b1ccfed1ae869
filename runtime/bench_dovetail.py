"""Drafter and target on different devices (Dovetail): the drafter on the GPU through the
torch engine, the target on CPU threads through llama.cpp, against single-device runs.

Placements, run alternately in one process on the same prompts (greedy, fixed draft
length, so every speculative placement must produce the plain output exactly):

* ``plain``: the target alone (CPU);
* ``draft-cpu``: drafter on the CPU (torch), drafting then verifying in turn;
* ``draft-gpu``: drafter on the GPU, in turn;
* ``draft-gpu+predraft``: drafter on the GPU drafting the next round while the CPU
  verifies this one (PEARL-style pre-drafting, :func:`tandem.runtime.split.split_speculative`).

    python -m tandem.runtime.bench_dovetail --target TWIN.gguf --drafter SMALL.gguf [--threads 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from tandem.kernels.sampling import Sampler, SamplingParams
from tandem.runtime.drafters.model import ModelDrafter
from tandem.runtime.generate import DoneEvent, autoregressive, generate
from tandem.runtime.llama_backend import LlamaConfig, LlamaCppBackend
from tandem.runtime.split import split_speculative

PROMPTS = ["Once upon a time", "The little dog ran to the park and", "Lily and Tom wanted to build a big castle"]


@dataclass
class PlacementResult:
    placement: str
    tokens_per_s: float
    tokens_per_call: float
    identical: bool


def run(target_path: Path, drafter_path: Path, *, threads: int, k: int, tokens: int, rounds: int) -> list[PlacementResult]:
    import torch

    from tandem.runtime.torch_engine.backend import TorchBackend, TorchConfig

    target = LlamaCppBackend(target_path, LlamaConfig(n_ctx=1024, n_threads=threads))
    drafters = {"cpu": ModelDrafter(TorchBackend(drafter_path, TorchConfig(device="cpu", n_ctx=1024)))}
    if torch.cuda.is_available():
        drafters["gpu"] = ModelDrafter(TorchBackend(drafter_path, TorchConfig(device="cuda", n_ctx=1024)))
    strategies = {"plain": autoregressive, "draft-cpu": split_speculative(drafters["cpu"], k, predraft=False)}
    if "gpu" in drafters:
        strategies["draft-gpu"] = split_speculative(drafters["gpu"], k, predraft=False)
        strategies["draft-gpu+predraft"] = split_speculative(drafters["gpu"], k, predraft=True)
    speeds: dict[str, list[float]] = {name: [] for name in strategies}
    per_call: dict[str, list[float]] = {name: [] for name in strategies}
    identical = dict.fromkeys(strategies, True)
    greedy = SamplingParams.greedy_params()
    try:
        for r in range(rounds):
            for text in PROMPTS:
                prompt = target.tokenize(text, add_bos=True)
                names = list(strategies)
                names = names[r % len(names):] + names[: r % len(names)]  # rotate who goes first
                outputs = {}
                for name in names:
                    target.truncate(0)
                    done = [e for e in generate(target, prompt, Sampler(greedy), strategy=strategies[name],
                                                max_tokens=tokens, stop_at_eog=False) if isinstance(e, DoneEvent)][0]
                    outputs[name] = done.tokens
                    speeds[name].append(done.stats.tokens_per_s)
                    per_call[name].append(done.stats.tokens_per_call)
                for name in strategies:
                    identical[name] &= outputs[name] == outputs["plain"]
    finally:
        target.close()
        for d in drafters.values():
            d.close()
    return [PlacementResult(n, statistics.median(speeds[n]), statistics.median(per_call[n]), identical[n])
            for n in strategies]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--drafter", type=Path, required=True)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("-k", type=int, default=4)
    p.add_argument("-n", "--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    results = run(args.target, args.drafter, threads=args.threads, k=args.k, tokens=args.tokens, rounds=args.rounds)
    base = results[0].tokens_per_s
    for res in results:
        print(f"{res.placement:20s} {res.tokens_per_s:8.2f} tok/s  {res.tokens_per_s / base:5.2f}x  "
              f"{res.tokens_per_call:4.2f} tok/call  identical={res.identical}")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
