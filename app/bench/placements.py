"""`tandem bench --gpu --vram SIZE`: a target bigger than the card, each placement the
planner compares, measured against plain llama.cpp partial offload at the same budget.

For a GPU budget the target does not fit whole, the memory planner prices (a) partial
offload with the drafter on the GPU, (b) the target on CPU threads with the drafter on
the GPU and (c) a quantized KV cache (:mod:`tandem.runtime.planning.offload`), and picks
one by predicted speed. Here every placement that fits is opened as planned and timed:

* **plain**: the target alone, placed as the option places it (its step cost);
* **speculative**: as `tandem run` runs it: the adaptive policy, model-free drafting and
  the drafter, placed as the option places it;

against **llama.cpp**: llama-cpp-python's own ``Llama`` with the most ``n_gpu_layers`` of
the target alone (f16 KV, no drafter) that fit the same budget (what a llama.cpp user
sets ``-ngl`` to). Each configuration is opened in turn (one at a time, so a card of the
budget's size holds it) and its runs are a block; blocks rotate order each repetition;
tok/s are medians with min-max and ratios to llama.cpp; the planner's pick is marked,
with its predicted tok/s beside the measured ones.

Bounded: repetitions after the first stop once ``deadline_s`` has passed (said in the
result); a configuration that fails to open or run leaves its error in its row and the
others still run. On random-weight real-shape models (the GPU machine) acceptance means
nothing: the plain rows are the placement's real cost, the speculative rows show the
loop's overhead; real acceptance comes from ``--acceptance`` (section 4).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from tandem.app.bench.report import spread
from tandem.runtime.planning.devices import max_gpu_layers
from tandem.runtime.planning.hardware import Machine, resolve_machine
from tandem.runtime.planning.memory_model import Estimate
from tandem.runtime.planning.plan import ModelPlan, OffloadOption, Plan, PlanRequest
from tandem.runtime.planning.planner import make_plan
from tandem.runtime.planning.shapes import shape_from_gguf

PEER = "llama.cpp"
DEADLINE_S = 150.0
"""Seconds of timing after which no further repetition starts (the first always runs):
a 7B target partly on CPU threads takes 50-75 ms a token, so a repetition of five
configurations at 32 tokens, plain and speculative, is about a minute with the loads."""


@dataclass(frozen=True)
class PlacementRun:
    """One configuration to time: a placement the planner compared, or the peer."""

    name: str
    target: ModelPlan | None = None
    """Tandem's target as the option places it; ``None`` for the peer."""
    draft: ModelPlan | None = None
    option: OffloadOption | None = None
    peer_layers: int = 0
    """The peer's ``n_gpu_layers``."""


@dataclass
class PlacementBenchConfig:
    target: Path
    draft: Path | None
    vram: str | int
    budget: str | int | None = None
    ctx: int = 1024
    threads: int | None = None
    n_tokens: int = 64
    prompts: int = 1
    reps: int = 3
    deadline_s: float = DEADLINE_S
    machine: Machine | None = None
    """Plan for this machine instead of this one with ``vram`` (tests: a profile's GPU)."""
    log: Callable[[str], None] = print


def option_plans(plan: Plan, option: OffloadOption) -> tuple[ModelPlan, ModelPlan | None]:
    """The target's and drafter's settings of ``option``: the plan's rung (context, batch,
    drafter window) with the option's layers and KV type. The planner compared every
    option at that rung, so this is what it priced."""
    target = replace(plan.target, n_gpu_layers=option.n_gpu_layers, type_k=option.type_k, type_v=option.type_k)
    draft = None
    if plan.draft is not None and option.draft_gpu_layers is not None:
        draft = replace(plan.draft, n_gpu_layers=option.draft_gpu_layers, device="cpu", devices=("cpu",))
    return target, draft


def peer_gpu_layers(plan: Plan, machine: Machine) -> int:
    """The most ``n_gpu_layers`` of the target alone, f16 KV, that fit the budget: plain
    llama.cpp partial offload at the same budget."""
    shape = shape_from_gguf(plan.target.path)
    alone = replace(plan.target, type_k="f16", type_v="f16", n_gpu_layers=0)
    return max_gpu_layers(shape, alone.setup(), machine, plan.baseline, Estimate())


def runs_for(plan: Plan, machine: Machine) -> list[PlacementRun]:
    """The peer, then each placement that fits and is allowed, in the plan's order."""
    out = [PlacementRun(PEER, peer_layers=peer_gpu_layers(plan, machine))]
    for o in plan.placements:
        if o.fits and o.allowed:
            target, draft = option_plans(plan, o)
            out.append(PlacementRun(f"{o.key}. {o.name} ({o.type_k})", target, draft, o))
    return out


def _plan(cfg: PlacementBenchConfig) -> tuple[Plan, Machine]:
    machine = cfg.machine or resolve_machine(None, cfg.budget, cfg.vram)
    plan = make_plan(PlanRequest(cfg.target, cfg.draft, cfg.ctx, machine, threads=cfg.threads, drop_slow_draft=False,
                                 model_free=True)).check()
    if plan.draft is not None and plan.draft.quant and plan.draft.source:
        from tandem.models.quantize import cached_copy

        plan.draft = replace(plan.draft, path=str(cached_copy(plan.draft.source, plan.draft.quant)))
    return plan, machine


def bench_placements(cfg: PlacementBenchConfig) -> dict:
    """Time each placement and the peer (module docstring); a dict for the JSON."""
    plan, machine = _plan(cfg)
    if not plan.placements:
        return {"skipped": "the target fits the GPU budget whole, or this llama.cpp build cannot offload: "
                           "there are no placements to compare", "n_gpu_layers": plan.target.n_gpu_layers}
    runs = runs_for(plan, machine)
    threads = cfg.threads or machine.cpu_cores
    prompts = _prompts(cfg)
    times: dict[str, dict[str, list[float]]] = {r.name: {"plain": [], "speculative": []} for r in runs}
    errors: dict[str, str] = {}
    started = time.perf_counter()
    reps_done, stopped = 0, False
    for rep in range(cfg.reps):
        if rep and time.perf_counter() - started > cfg.deadline_s:
            stopped = True
            break
        order = runs[rep % len(runs):] + runs[:rep % len(runs)]
        for run in order:
            if run.name in errors:
                continue
            cfg.log(f"  placements rep {rep + 1}/{cfg.reps}: {run.name}")
            try:
                for mode, rate in _time_block(run, plan, prompts, cfg.n_tokens, threads).items():
                    times[run.name][mode] += rate
            except Exception as exc:  # noqa: BLE001  # one configuration's failure is its row's
                errors[run.name] = f"{type(exc).__name__}: {exc}".splitlines()[0]
        reps_done += 1
    return _result(plan, runs, times, errors, reps_done, stopped, cfg.deadline_s)


def _prompts(cfg: PlacementBenchConfig) -> list[list[int]]:
    """The edit workload's prompts as the target's token ids, from its vocabulary alone
    (no weights loaded: every configuration opens the target its own way)."""
    from tandem.app.bench.workloads import workload
    from tandem.runtime.backends.llama_vocab import LlamaVocab

    vocab = LlamaVocab.open(cfg.target)
    try:
        return workload(vocab, "edit", cfg.prompts).prompts  # type: ignore[arg-type]  # the tokenizer half suffices
    finally:
        vocab.close()


def _time_block(run: PlacementRun, plan: Plan, prompts: Sequence[list[int]], n: int, threads: int,
                ) -> dict[str, list[float]]:
    """Open ``run``'s configuration, time every prompt (plain, then speculative for a
    placement), close it."""
    if run.target is None:
        from tandem.app.bench.peers import LlamaPeer

        peer = LlamaPeer(Path(plan.target.path), n_ctx=plan.target.n_ctx, threads=threads, lookup=False,
                         n_gpu_layers=run.peer_layers)
        try:
            peer.run(prompts[0], 2)  # first launches (kernels, graphs) are not counted
            return {"plain": [peer.run(p, n).tokens_per_s for p in prompts]}
        finally:
            peer.close()
    from tandem.app.bench.run import run_tandem
    from tandem.runtime.backends.opener import open_backend
    from tandem.runtime.engine import Engine, EngineSpec
    from tandem.runtime.speculative.factory import SpecOptions, build_strategy

    target = open_backend(plan.target.path, llama_config=replace(run.target.llama_config(), n_threads=threads))
    drafter = engine = None
    try:
        if run.draft is not None:
            drafter = open_backend(run.draft.path, llama_config=replace(run.draft.llama_config(), n_threads=threads))
        options = SpecOptions(mode="auto", draft_max=plan.draft_max, suffix_memory="request",
                              draft_window=run.draft.window if run.draft else None)
        engine = Engine(EngineSpec(Path(plan.target.path), Path(run.draft.path) if run.draft else None), target,
                        build_strategy(target, drafter, options), "llama.cpp", drafter_backend=drafter,
                        options=options)
        target = drafter = None  # the engine owns them
        run_tandem(engine, prompts[0], 2, shared_suffix_cache=False)  # warm-up, not counted
        out: dict[str, list[float]] = {"plain": [], "speculative": []}
        plain = replace(engine, options=replace(options, mode="off"))  # the same backends, no drafting
        for prompt in prompts:
            out["plain"].append(run_tandem(plain, prompt, n, shared_suffix_cache=False).tokens_per_s)
            out["speculative"].append(run_tandem(engine, prompt, n, shared_suffix_cache=False).tokens_per_s)
        return out
    finally:
        for thing in (engine, drafter, target):
            if thing is not None:
                thing.close()


def _result(plan: Plan, runs: list[PlacementRun], times: dict[str, dict[str, list[float]]], errors: dict[str, str],
            reps_done: int, stopped: bool, deadline_s: float) -> dict:
    peer = times[PEER]["plain"]
    peer_median = spread(peer)["median"] if peer else None
    rows = []
    for run in runs:
        row: dict = {"name": run.name}
        if run.option is None:
            row.update(n_gpu_layers=run.peer_layers, type_k="f16", chosen=False)
        else:
            o = run.option
            row.update(key=o.key, n_gpu_layers=o.n_gpu_layers, type_k=o.type_k, chosen=o.chosen,
                       draft_gpu_layers=o.draft_gpu_layers, host_bytes=o.host_bytes, gpu_bytes=o.gpu_bytes,
                       predicted_tok_s={"plain": round(o.tokens_per_s, 2),
                                        "speculative": round(o.speculative_tokens_per_s, 2)})
        if run.name in errors:
            row["error"] = errors[run.name]
        measured = {mode: spread(v) for mode, v in times[run.name].items() if v}
        row["tok_s"] = measured
        if peer_median:
            row["ratio_to_llama"] = {mode: round(s["median"] / peer_median, 3) for mode, s in measured.items()}
        rows.append(row)
    return {"vram_budget": plan.vram_budget, "host_budget": plan.host_budget, "n_ctx": plan.target.n_ctx,
            "draft": Path(plan.draft.path).name if plan.draft else None, "reps": reps_done,
            "stopped": f"stopped after {reps_done} repetition(s): past the {deadline_s:.0f} s deadline" if stopped
            else None, "rows": rows}


def format_placements(res: dict) -> list[str]:
    """The section's lines for `tandem bench --gpu`'s report."""
    from tandem.runtime.planning.hardware import format_size

    if "skipped" in res:
        return [f"[5] placements: skipped: {res['skipped']}"]
    lines = [f"[5] bigger than the card: {format_size(res['vram_budget'])} GPU budget, ctx {res['n_ctx']}, "
             f"drafter {res['draft'] or '-'}; tok/s median (min-max), ratio to plain llama.cpp partial offload"]
    for row in res["rows"]:
        mark = "  <- planner's pick" if row["chosen"] else ""
        head = f"  {row['name'][:44]:44s} ngl {row['n_gpu_layers']:>3}"
        if "error" in row:
            lines.append(f"{head}  failed: {row['error']}")
            continue
        cells = []
        for mode in ("plain", "speculative"):
            s = row["tok_s"].get(mode)
            if s:
                ratio = row.get("ratio_to_llama", {}).get(mode)
                cells.append(f"{mode} {s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f})"
                             + (f" {ratio:.2f}x" if ratio is not None else ""))
        predicted = row.get("predicted_tok_s")
        if predicted:
            cells.append(f"predicted {predicted['plain']:.1f}/{predicted['speculative']:.1f}")
        lines.append(f"{head}  " + "; ".join(cells) + mark)
    if res.get("stopped"):
        lines.append(f"  {res['stopped']}")
    return lines

