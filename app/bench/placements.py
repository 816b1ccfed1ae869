"""`tandem bench --gpu --vram SIZE`: a target bigger than the card, each placement the
planner compares, measured against plain llama.cpp partial offload at the same budget.

For a GPU budget the target does not fit whole, the memory planner prices (a) partial
offload with the drafter on the GPU, (b) the target on CPU threads with the drafter on
the GPU and (c) a quantized KV cache (:mod:`tandem.runtime.planning.offload`), and picks
one by predicted speed. Here every placement that fits is opened as ``tandem run --vram
SIZE --offload NAME`` opens it (:func:`~tandem.runtime.engine.builder.open_engine`, the planner
pinned to that placement) and timed:

* **plain**: the same engine with drafting off: the target's step cost as placed (the
  drafter stays loaded, idle, as its memory would be);
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
from dataclasses import dataclass, field, replace
from pathlib import Path

from tandem.app.bench.report import spread
from tandem.app.bench.workloads import workload
from tandem.runtime.engine.builder import open_engine, plan_llama
from tandem.runtime.engine.spec import EngineSpec
from tandem.runtime.planning.devices import max_gpu_layers
from tandem.runtime.planning.hardware import Machine, format_size, resolve_machine
from tandem.runtime.planning.memory_model import Estimate
from tandem.runtime.planning.plan import OffloadOption, Plan
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
    option: OffloadOption | None = None
    """The placement, opened with ``--offload`` its :attr:`~OffloadOption.pin`; ``None``
    for the peer."""
    peer_layers: int = 0
    """The peer's ``n_gpu_layers``."""


@dataclass
class Timed:
    """One configuration's block: tok/s per mode, and the target's ``n_gpu_layers`` as
    opened (the engine plans again when it opens; a process grown since the bench's own
    plan may be given fewer layers, and the row then says so)."""

    rates: dict[str, list[float]] = field(default_factory=dict)
    n_gpu_layers: int | None = None


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
    log: Callable[[str], None] = print


def engine_spec(cfg: PlacementBenchConfig, threads: int) -> EngineSpec:
    """What ``tandem run -m TARGET --draft DRAFT --vram SIZE --budget SIZE --ctx N
    --threads T`` asks for; each placement adds ``--offload``. Each request drafts from
    itself alone, and llama.cpp's weights stay as stored (no background kernel probe
    during the timing)."""
    return EngineSpec(cfg.target, cfg.draft, budget=cfg.budget, vram=cfg.vram, engine="llama.cpp", threads=threads,
                      n_ctx=cfg.ctx, repack=False, suffix_memory="request")


def peer_gpu_layers(plan: Plan, machine: Machine) -> int:
    """The most ``n_gpu_layers`` of the target alone, f16 KV, that fit the budget: plain
    llama.cpp partial offload at the same budget."""
    shape = shape_from_gguf(plan.target.path)
    alone = replace(plan.target, type_k="f16", type_v="f16", n_gpu_layers=0)
    return max_gpu_layers(shape, alone.setup(), machine, plan.baseline, Estimate())


def runs_for(plan: Plan, machine: Machine) -> list[PlacementRun]:
    """The peer, then each placement that fits and is allowed, in the plan's order."""
    out = [PlacementRun(PEER, peer_layers=peer_gpu_layers(plan, machine))]
    out += [PlacementRun(f"{o.pin}. {o.name} ({o.type_k})", o) for o in plan.placements if o.fits and o.allowed]
    return out


def bench_placements(cfg: PlacementBenchConfig) -> dict:
    """Time each placement and the peer (module docstring); a dict for the JSON."""
    machine = resolve_machine(None, cfg.budget, cfg.vram, measure_bandwidth=False)  # as the engine's planner
    spec = engine_spec(cfg, cfg.threads or machine.cpu_cores)
    plan = plan_llama(spec)  # the placements the planner compares, as `tandem run` would see them
    if not plan.placements:
        return {"skipped": "the target fits the GPU budget whole, or this llama.cpp build cannot offload: "
                           "there are no placements to compare", "n_gpu_layers": plan.target.n_gpu_layers}
    runs = runs_for(plan, machine)
    prompts = _prompts(cfg)
    times: dict[str, dict[str, list[float]]] = {r.name: {"plain": [], "speculative": []} for r in runs}
    opened: dict[str, int] = {}
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
                timed = _time_block(run, spec, plan, prompts, cfg.n_tokens)
            except Exception as exc:  # noqa: BLE001  # one configuration's failure is its row's
                errors[run.name] = f"{type(exc).__name__}: {exc}".splitlines()[0]
                continue
            for mode, rates in timed.rates.items():
                times[run.name][mode] += rates
            if timed.n_gpu_layers is not None:
                opened[run.name] = timed.n_gpu_layers
        reps_done += 1
    return _result(plan, runs, times, opened, errors, reps_done, stopped, cfg.deadline_s)


def _prompts(cfg: PlacementBenchConfig) -> list[list[int]]:
    """The edit workload's prompts as the target's token ids, from its vocabulary alone
    (no weights loaded: every configuration opens the target its own way)."""
    # local: loads llama.cpp only when this runs
    from tandem.runtime.backends.llama_vocab import LlamaVocab

    vocab = LlamaVocab.open(cfg.target)
    try:
        return workload(vocab, "edit", cfg.prompts).prompts  # type: ignore[arg-type]  # the tokenizer half suffices
    finally:
        vocab.close()


def _time_block(run: PlacementRun, spec: EngineSpec, plan: Plan, prompts: Sequence[list[int]], n: int) -> Timed:
    """Open ``run``'s configuration, time every prompt (plain, then speculative for a
    placement), close it. A placement is opened by :func:`open_engine` with ``--offload``
    pinning it, as `tandem run` opens it; its plain runs use the same engine with
    drafting off."""
    if run.option is None:
        # local: loads llama.cpp only when this runs
        from tandem.app.bench.peers import LlamaPeer

        peer = LlamaPeer(Path(plan.target.path), n_ctx=plan.target.n_ctx, threads=spec.threads, lookup=False,
                         n_gpu_layers=run.peer_layers)
        try:
            peer.run(prompts[0], 2)  # first launches (kernels, graphs) are not counted
            return Timed({"plain": [peer.run(p, n).tokens_per_s for p in prompts]})
        finally:
            peer.close()
    # local: loads llama.cpp only when this runs
    from tandem.app.bench.runner import run_tandem

    engine = open_engine(replace(spec, offload=run.option.pin))
    try:
        run_tandem(engine, prompts[0], 2, shared_suffix_cache=False)  # warm-up, not counted
        out: dict[str, list[float]] = {"plain": [], "speculative": []}
        for prompt in prompts:
            out["plain"].append(run_tandem(engine, prompt, n, shared_suffix_cache=False, mode="off").tokens_per_s)
            out["speculative"].append(run_tandem(engine, prompt, n, shared_suffix_cache=False).tokens_per_s)
        return Timed(out, engine.plan.target.n_gpu_layers if engine.plan is not None else None)
    finally:
        engine.close()


def _result(plan: Plan, runs: list[PlacementRun], times: dict[str, dict[str, list[float]]], opened: dict[str, int],
            errors: dict[str, str], reps_done: int, stopped: bool, deadline_s: float) -> dict:
    peer = times[PEER]["plain"]
    peer_median = spread(peer)["median"] if peer else None
    rows = []
    for run in runs:
        row: dict = {"name": run.name}
        if run.option is None:
            row.update(n_gpu_layers=run.peer_layers, type_k="f16", chosen=False)
        else:
            o = run.option
            row.update(key=o.key, offload=o.pin, n_gpu_layers=o.n_gpu_layers, type_k=o.type_k, chosen=o.chosen,
                       draft_gpu_layers=o.draft_gpu_layers, host_bytes=o.host_bytes, gpu_bytes=o.gpu_bytes,
                       predicted_tok_s={"plain": round(o.tokens_per_s, 2),
                                        "speculative": round(o.speculative_tokens_per_s, 2)})
            if opened.get(run.name, o.n_gpu_layers) != o.n_gpu_layers:
                row["opened_n_gpu_layers"] = opened[run.name]
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

    if "skipped" in res:
        return [f"[5] placements: skipped: {res['skipped']}"]
    lines = [f"[5] bigger than the card: {format_size(res['vram_budget'])} GPU budget, ctx {res['n_ctx']}, "
             f"drafter {res['draft'] or '-'}; tok/s median (min-max), ratio to plain llama.cpp partial offload"]
    for row in res["rows"]:
        mark = "  <- planner's pick" if row["chosen"] else ""
        head = f"  {row['name'][:44]:44s} ngl {row['n_gpu_layers']:>3}"
        if "opened_n_gpu_layers" in row:
            head += f" (opened with {row['opened_n_gpu_layers']})"
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

