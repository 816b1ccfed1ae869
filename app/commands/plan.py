"""`tandem plan`: how a target + drafter pair will fit this machine (or another), and why."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tandem.models.store import resolve_model
from tandem.runtime.planning.calibration import calibrate
from tandem.runtime.planning.hardware import PROFILES, format_size, resolve_machine
from tandem.runtime.planning.placement import Choice, plan_options
from tandem.runtime.planning.plan import Plan, PlanRequest
from tandem.runtime.planning.planner import make_plan


def add_budget_args(p: argparse.ArgumentParser) -> None:
    """``--budget/--vram/--profile``, shared with run and chat."""
    g = p.add_argument_group("memory")
    g.add_argument("--budget", default=None,
                   help="host memory the process may use, e.g. 6GiB (default: 85%% of available RAM)")
    g.add_argument("--vram", default=None, help="GPU memory the plan may use, e.g. 4GiB (default: 92%% of free)")
    g.add_argument("--profile", default=None, choices=sorted(PROFILES),
                   help="plan for a named machine instead of this one")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="plan memory and devices for a target (+ drafter) on this machine")
    p.add_argument("-m", "--model", required=True, help="target GGUF file or a name from `tandem models`")
    p.add_argument("--draft", default=None, help="draft model GGUF (optional)")
    p.add_argument("--ctx", type=int, default=None, help="context wanted (default: the model's, ≤ 4096)")
    p.add_argument("--draft-max", type=int, default=8, help="most drafts per round to budget for")
    p.add_argument("--threads", type=int, default=None, help="CPU threads to plan for (default: every core)")
    p.add_argument("--no-kv-quant", action="store_true", help="never quantize the target's KV cache")
    p.add_argument("--calibrate", action="store_true",
                   help="also load the pair and measure where the drafter runs fastest (what run/chat do "
                        "at first use; cached)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    add_budget_args(p)
    p.set_defaults(func=run)


def mib(n: int) -> str:
    """Bytes in MiB to the thousandth: one unit for every row, so the rows visibly add
    up to the total (each within 0.0005 MiB of rounding)."""
    return f"{n / 1024**2:.3f} MiB"


def render(plan: Plan) -> str:
    """The plan as a few readable lines."""
    t, d = plan.target, plan.draft
    lines = [f"machine: {plan.machine}",
             f"budget:  {format_size(plan.host_budget)} host" + (f", {format_size(plan.vram_budget)} GPU"
                                                                  if plan.vram_budget else ""),
             "fits:    " + ("yes" if plan.fits else "NO")]
    if plan.fits:
        lines.append(f"target:  {Path(t.path).name}  ctx {t.n_ctx}  kv {t.type_k}  batch {t.n_batch}  "
                     f"gpu layers {t.n_gpu_layers}")
        if d is not None:
            lines.append(f"drafter: {Path(d.path).name}  ctx {d.n_ctx}" + (f" (window {d.window})" if d.window else "")
                         + f"  kv {d.type_k}  gpu layers {d.n_gpu_layers}  drafts/round ≤ {plan.draft_max}")
        else:
            lines.append(f"drafter: model-free only (drafts/round ≤ {plan.draft_max})")
        lines.append(f"memory:  {mib(plan.host_total)} host peak resident (RSS)"
                     + (f" + {mib(plan.memory.gpu)} GPU" if plan.memory.gpu else "") + ", made of:")
        lines.append(f"  {mib(plan.baseline):>12}  host  process baseline (interpreter and libraries, measured)")
        for item in plan.memory.items:
            lines.append(f"  {mib(item.bytes):>12}  {item.device:4}  {item.label}")
        lines.append(f"speed:   ~{plan.tokens_per_s:.1f} tok/s plain, ~{plan.tokens_per_s * plan.speedup:.1f} "
                     f"tok/s speculative (predicted)")
    lines.append("why:")
    lines += [f"  - {r}" for r in plan.reasons]
    if plan.suggestions:
        lines.append("what would fit:")
        lines += [f"  - {s}" for s in plan.suggestions]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    machine = resolve_machine(args.profile, args.budget, args.vram)
    draft = resolve_model(args.draft) if args.draft else None
    # A drafter named explicitly is kept when it fits, as `tandem run` keeps it (the
    # adaptive policy turns drafting off at run time if it does not pay), so the plan
    # prices what run will hold.
    plan = make_plan(PlanRequest(resolve_model(args.model), draft, args.ctx, machine, draft_max=args.draft_max,
                                 allow_kv_quant=not args.no_kv_quant, threads=args.threads,
                                 drop_slow_draft=draft is None, baseline=run_baseline(machine)))
    choice = calibrated(plan) if args.calibrate and plan.fits and plan.draft is not None else None
    if args.json:
        out = plan.as_dict()
        if choice is not None:
            out["placement"] = choice.as_dict()
        print(json.dumps(out))
    else:
        print(render(plan) + ("\n" + render_choice(choice) if choice is not None else ""))
    return 0 if plan.fits else 6


def run_baseline(machine) -> int | None:
    """The baseline of the `tandem run` this plan is for: this machine's measured one
    (cached), not this planning process's own resident size, so identical calls print
    identical plans; ``None`` (the profile's) when planning another machine."""
    if machine.source != "detected":
        return None
    from tandem.runtime.planning.baseline import machine_baseline

    return machine_baseline().total


def calibrated(plan: Plan) -> Choice:
    """Open the planned target and measure the drafter's placement options."""
    from tandem.runtime.backends.opener import open_backend

    target = open_backend(plan.target.path, llama_config=plan.target.llama_config())
    try:
        return calibrate(target, plan, plan_options(plan))
    finally:
        target.close()


def render_choice(choice: Choice) -> str:
    lines = ["placement (measured" + (", cached" if choice.cached else "") + "):",
             f"  plain decoding   ~{choice.plain:.1f} tok/s"]
    for name, tps in sorted(choice.predicted.items(), key=lambda kv: -kv[1]):
        mark = "  <- chosen" if name == choice.option.name else ""
        lines.append(f"  {name:34} ~{tps:.1f} tok/s{mark}")
    c = choice.costs
    lines.append("  costs (cpu/N: N threads): "
                 + ", ".join([*(f"decode {v * 1e3:.2f} ms {t}" for t, v in c.decode_s.items()),
                              *(f"verify {v * 1e3:.2f} ms {t}" for t, v in c.verify_s.items()),
                              *(f"draft {v * 1e3:.2f} ms/token {d}" for d, v in c.draft_s.items()),
                              *(f"acceptance {v:.2f} {d}" for d, v in c.acceptance.items())]))
    return "\n".join(lines)
