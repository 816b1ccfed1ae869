"""Does the placement calibration choose the fastest option? Predicted vs measured.

For a target + drafter pair planned for this machine, every placement option the
planner allows (drafter on the GPU with/without pre-drafting, on the CPU sequentially,
CPU thread splits with pre-drafting) is calibrated (:mod:`tandem.runtime.planning.placement`)
and then *run* end to end: greedy, fixed draft length ``k`` (the length the options are
compared at), alternating with plain decoding in one process, medians over rounds and
prompts. Every option must reproduce plain decoding token for token — the plain decoding
of the backend its target runs in (a target on the GPU runs in the torch engine, whose
float32 arithmetic on dequantized weights may break a near-tie differently from
llama.cpp's quantized dot products).

    python -m benchmarks.placement --target TWIN.gguf --draft SMALL.gguf [--threads 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path

from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.backends.opener import open_backend
from tandem.runtime.generate import DoneEvent, autoregressive, generate
from tandem.runtime.planning.calibration import calibrate
from tandem.runtime.planning.placement import CALIBRATION_K, Option, plan_options
from tandem.runtime.planning.planner import plan_for_run
from tandem.runtime.speculative.factory import SpecOptions, build_strategy

PROMPTS = ["Once upon a time", "The little dog ran to the park and", "Lily and Tom wanted to build a big castle"]


def _run(target, prompt: list[int], strategy, tokens: int) -> DoneEvent:
    target.truncate(0)
    greedy = Sampler(SamplingParams.greedy_params())
    return [e for e in generate(target, prompt, greedy, strategy=strategy, max_tokens=tokens, stop_at_eog=False)
            if isinstance(e, DoneEvent)][0]


def bench(target_path: Path, draft_path: Path, *, threads: int, ctx: int, tokens: int, rounds: int) -> dict:
    plan = plan_for_run(target_path, draft_path, ctx=ctx, threads=threads, drop_slow_draft=False)
    if plan.draft is None:
        raise SystemExit("the planner dropped the drafter: nothing to place")
    target = open_backend(target_path, llama_config=plan.target.llama_config())
    opts = plan_options(plan)
    choice = calibrate(target, plan, opts, mode="model", use_cache=False)
    targets = {"cpu": target}
    if any(o.target_device == "cuda" for o in opts):
        from tandem.runtime.backends.torch_engine.backend import TorchBackend

        targets["cuda"] = TorchBackend(target_path, plan.target.torch_config("cuda"))

    def strategy(o: Option):
        cfg = replace(plan.draft.llama_config(), n_threads=o.draft_threads)
        return build_strategy(targets[o.target_device], plan.draft.path, SpecOptions(mode="model", draft_length=CALIBRATION_K,
                                                                   draft_device=o.draft_device, predraft=o.predraft),
                              llama_config=cfg, torch_config=plan.draft.torch_config("cuda"))

    strategies = {o.name: (o, strategy(o)) for o in opts}
    plain_name = {"cpu": "plain", "cuda": "plain, target on GPU"}
    speeds: dict[str, list[float]] = {plain_name[d]: [] for d in targets} | {n: [] for n in strategies}
    identical = dict.fromkeys(strategies, True)
    try:
        for r in range(rounds):
            for text in PROMPTS:
                prompt = target.tokenize(text, add_bos=True)
                target.set_threads(threads)
                plain = {}
                for device, t in targets.items():  # each backend's own greedy output is the reference
                    plain[device] = _run(t, prompt, autoregressive, tokens)
                    speeds[plain_name[device]].append(plain[device].stats.tokens_per_s)
                names = list(strategies)
                names = names[r % len(names):] + names[: r % len(names)]
                for name in names:
                    o, s = strategies[name]
                    target.set_threads(o.target_threads)
                    done = _run(targets[o.target_device], prompt, s, tokens)
                    speeds[name].append(done.stats.tokens_per_s)
                    identical[name] &= done.tokens == plain[o.target_device].tokens
    finally:
        for _, s in strategies.values():
            s.close()
        for t in targets.values():
            t.close()
    measured = {n: statistics.median(v) for n, v in speeds.items()}
    best = max(strategies, key=measured.get)
    return {"target": target_path.name, "draft": draft_path.name, "threads": threads, "k": CALIBRATION_K,
            "chosen": choice.option.name, "measured_best": best,
            "chosen_vs_best": measured[choice.option.name] / measured[best],
            "predicted_plain": 1.0 / choice.costs.decode_s[f"cpu/{threads}"], "measured_plain": measured["plain"],
            "measured_plain_target_gpu": measured.get(plain_name["cuda"]),
            "options": [{"name": n, "predicted": choice.predicted[n], "measured": measured[n],
                         "vs_plain": measured[n] / measured["plain"], "identical": identical[n]}
                        for n in strategies],
            "costs": choice.as_dict()["costs"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--draft", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("-n", "--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out = bench(args.target, args.draft, threads=args.threads, ctx=args.ctx, tokens=args.tokens, rounds=args.rounds)
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"{out['target']} + {out['draft']}, {out['threads']} threads, k = {out['k']}")
    print("| option | predicted tok/s | measured tok/s | vs plain | identical |\n|---|---|---|---|---|")
    print(f"| plain | {out['predicted_plain']:.1f} | {out['measured_plain']:.1f} | 1.00x | - |")
    if out["measured_plain_target_gpu"]:
        gpu = out["measured_plain_target_gpu"]
        print(f"| plain, target on GPU | {1 / out['costs']['decode_s']['cuda']:.1f} | {gpu:.1f} | "
              f"{gpu / out['measured_plain']:.2f}x | - |")
    for o in out["options"]:
        mark = " (chosen)" if o["name"] == out["chosen"] else ""
        print(f"| {o['name']}{mark} | {o['predicted']:.1f} | {o['measured']:.1f} | {o['vs_plain']:.2f}x | "
              f"{'yes' if o['identical'] else 'NO'} |")
    print(f"chosen: {out['chosen']}; measured best: {out['measured_best']}; "
          f"chosen runs at {out['chosen_vs_best']:.2f} of the best")


if __name__ == "__main__":
    main()
