"""`tandem plan`: how a target + drafter pair will fit this machine (or another), and why."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from tandem.app.commands.engine_flags import MODEL_HELP, add_technique_flags, moe_spec
from tandem.app.progress import Progress
from tandem.errors import BudgetError, TandemError
from tandem.models.store import resolve_model
from tandem.runtime.backends.opener import open_backend
from tandem.runtime.choices import MODES, OFFLOAD_CHOICES
from tandem.runtime.engine.checks import check_spec, target_engine
from tandem.runtime.engine.spec import EngineSpec
from tandem.runtime.kv.config import PRESETS
from tandem.runtime.planning.baseline import machine_baseline
from tandem.runtime.planning.calibration import calibrate
from tandem.runtime.planning.hardware import PROFILES, format_size, resolve_machine
from tandem.runtime.planning.options import TechniqueOption, llama_kv_options, torch_options
from tandem.runtime.planning.placement import Choice, plan_options
from tandem.runtime.planning.plan import OffloadOption, Plan, PlanRequest
from tandem.runtime.planning.planner import make_plan
from tandem.runtime.planning.torch_target import TorchPlan, check_fits, plan_torch


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
    p.add_argument("-m", "--model", required=True, help="the target: " + MODEL_HELP)
    p.add_argument("--draft", default=None, help="draft model GGUF (optional)")
    p.add_argument("--ctx", type=int, default=None, help="context wanted (default: the model's, ≤ 4096)")
    p.add_argument("--draft-max", type=int, default=8, help="most drafts per round to budget for")
    p.add_argument("--threads", type=int, default=None, help="CPU threads to plan for (default: every core)")
    p.add_argument("--no-kv-quant", action="store_true", help="never quantize the target's KV cache")
    p.add_argument("--draft-mode", choices=MODES, default="auto",
                   help="as `tandem run` (default auto: model-free drafting's index is priced)")
    p.add_argument("--calibrate", action="store_true",
                   help="also load the pair and measure where the drafter runs fastest (what run/chat do "
                        "at first use; cached)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    add_budget_args(p)
    add_technique_flags(p)
    p.set_defaults(func=run)


def mib(n: int) -> str:
    """Bytes in MiB to the thousandth: one unit for every row, so the rows visibly add
    up to the total (each within 0.0005 MiB of rounding)."""
    return f"{n / 1024**2:.3f} MiB"


def where_parts(plan: Plan) -> list[str]:
    """Each part's bytes on the GPU and on the host (``target 1.1 GiB GPU + 0.2 GiB host``)."""
    names = {"target": "target", "draft": "drafter", "speculation": "speculation", "runtime": "runtime"}
    parts = []
    for role, name in names.items():
        shares = [f"{format_size(plan.memory.total(device, role))} {label}"
                  for device, label in (("gpu", "GPU"), ("host", "host")) if plan.memory.total(device, role)]
        if shares:
            parts.append(f"{name} " + " + ".join(shares))
    return parts


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
        if plan.memory.gpu:
            lines.append("where:   " + "; ".join(where_parts(plan)))
        lines.append(f"speed:   ~{plan.tokens_per_s:.1f} tok/s plain, ~{plan.tokens_per_s * plan.speedup:.1f} "
                     f"tok/s speculative (predicted from memory bandwidth, to compare plans; "
                     "`tandem bench` measures)")
    if plan.placements:
        lines += render_placements(plan.placements)
    lines.append("why:")
    lines += [f"  - {r}" for r in plan.reasons]
    if plan.suggestions:
        lines.append("what would fit:")
        lines += [f"  - {s}" for s in plan.suggestions]
    return "\n".join(lines)


def render_placements(options: list[OffloadOption]) -> list[str]:
    """The placements compared for a target bigger than the GPU budget, each with its
    memory, predicted speed and why it won or lost."""
    lines = ["placements (the target does not fit the GPU budget whole; tok/s predicted, plain / speculative; "
             f"--offload {'|'.join(OFFLOAD_CHOICES)} pins one):"]
    for o in options:
        layers = "all" if o.n_gpu_layers < 0 else str(o.n_gpu_layers)
        drafter = "" if o.draft_gpu_layers is None else (
            ", drafter on the GPU" if o.draft_gpu_layers else ", drafter on the CPU")
        speed = f"~{o.tokens_per_s:.1f} / ~{o.speculative_tokens_per_s:.1f} tok/s"
        lines.append(f"  {o.pin}. {o.name}, kv {o.type_k}: target n_gpu_layers {layers}{drafter}; "
                     f"{format_size(o.host_bytes)} host + {format_size(o.gpu_bytes)} GPU; {speed}"
                     + ("  <- chosen" if o.chosen else ""))
        if o.note:
            lines.append(f"       {o.note}")
    return lines


def run(args: argparse.Namespace) -> int:
    target = resolve_model(args.model)
    spec = EngineSpec(target, engine=args.engine, device=args.device, kv_type=args.kv_type, offload=args.offload,
                      kv_compress=PRESETS[args.kv_compress].config if args.kv_compress != "none" else None,
                      moe_offload=moe_spec(args))
    kind = target_engine(spec)
    check_spec(spec, kind)
    if kind == "torch":
        return run_torch(args, spec)
    if kind != "llama.cpp":
        raise TandemError("`tandem plan` plans GGUF targets (llama.cpp, or the torch engine with --engine torch).")
    # A model's first plan measures (llama.cpp's buffer sizes; on a new machine its baseline): seconds.
    with Progress(f"planning {target.name}") as progress:
        machine = resolve_machine(args.profile, args.budget, args.vram)
        draft = resolve_model(args.draft) if args.draft else None
        # A drafter named explicitly is kept when it fits, as `tandem run` keeps it (the
        # adaptive policy turns drafting off at run time if it does not pay), so the plan
        # prices what run will hold.
        plan = make_plan(PlanRequest(target, draft, args.ctx, machine, draft_max=args.draft_max,
                                     allow_kv_quant=not args.no_kv_quant, kv_type=args.kv_type, threads=args.threads,
                                     drop_slow_draft=draft is None, baseline=run_baseline(machine),
                                     model_free=args.draft_mode in ("auto", "ngram"),
                                     moe_offload=spec.moe_offload is not None, offload=args.offload))
        choice = None
        if args.calibrate and plan.fits and plan.draft is not None:
            progress.stage("calibrating placements")
            choice = calibrated(plan)
        progress.stage("pricing the options")
        n_ctx = plan.target.n_ctx
        options = [*llama_kv_options(target, n_ctx, plan.target.type_k if plan.fits else None),
                   *torch_options(target, n_ctx)]
    if args.json:
        out = plan.as_dict()
        out["options"] = [asdict(o) for o in options]
        if choice is not None:
            out["placement"] = choice.as_dict()
        print(json.dumps(out))
    else:
        print(render(plan) + ("\n" + render_choice(choice) if choice is not None else "")
              + "\n" + render_options(options))
    return 0 if plan.fits else 6


def run_torch(args: argparse.Namespace, spec: EngineSpec) -> int:
    """The torch engine's plan: its memory with the chosen options, and every option."""
    with Progress(f"planning {Path(spec.target).name}"):
        plan = plan_torch(spec.target, budget=args.budget, ctx=args.ctx, device=spec.device,
                          draft_max=args.draft_max, kv_compress=spec.kv_compress, moe=spec.moe_offload,
                          vram=args.vram, profile=args.profile, check=False)
    fits = True
    why = None
    try:
        check_fits(plan)
    except BudgetError as exc:
        fits, why = False, str(exc)
    options = torch_options(spec.target, plan.n_ctx, plan.kv_label or "none")
    if args.json:
        print(json.dumps({**plan.as_dict(), "fits": fits, "refusal": why, "options": [asdict(o) for o in options]}))
    else:
        print(render_torch(plan, fits, why) + "\n" + render_options(options))
    return 0 if fits else 6


def render_torch(plan: TorchPlan, fits: bool, why: str | None) -> str:
    lines = [f"engine:  torch on {plan.device}", f"budget:  {format_size(plan.host_budget)} host",
             "fits:    " + ("yes" if fits else "NO"), f"target:  {Path(plan.path).name}  ctx {plan.n_ctx}"
             + (f"  kv {plan.kv_label}" if plan.kv_label else "  kv float32")
             + (f"  experts offloaded ({plan.offload_label})" if plan.offload_label else ""),
             f"memory:  {mib(plan.host_peak)} host peak resident (RSS)"
             + (f" + {mib(plan.gpu_peak)} GPU" if plan.on_gpu else "") + f"; loading holds {mib(plan.load_peak)}"
             + ", running:",
             f"  {mib(plan.baseline):>12}  host  process baseline (interpreter, torch and libraries, measured)"]
    lines += [f"  {mib(i.bytes):>12}  {i.device:4}  {i.label}" for i in plan.memory.items]
    lines.append("why:")
    lines += [f"  - {r}" for r in plan.reasons + plan.quality]
    if why:
        lines.append(f"  - {why}")
    return "\n".join(lines)


def render_options(options: list[TechniqueOption]) -> str:
    """Every memory technique with its bytes and measured quality cost (BENCHMARKS.md)."""
    lines = ["options (memory each holds at this context; quality cost as measured):"]
    lines += [f"  {o.line()}" for o in options]
    return "\n".join(lines)


def run_baseline(machine) -> int | None:
    """The baseline of the `tandem run` this plan is for: this machine's measured one
    (cached), not this planning process's own resident size, so identical calls print
    identical plans; ``None`` (the profile's) when planning another machine."""
    if machine.source != "detected":
        return None
    return machine_baseline().total


def calibrated(plan: Plan) -> Choice:
    """Open the planned target and measure the drafter's placement options."""
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
