"""`tandem bench`: plain Tandem vs every drafting mode vs llama-cpp-python, same prompts.

Everything runs in one process on one target file, opened by the engine builder every
front end uses (:func:`tandem.runtime.engine.open_engine`: planned, exact configuration,
``--kv-type`` and ``--budget`` as in ``tandem run``). Each Tandem configuration is built
through :func:`~tandem.runtime.speculative.factory.build_strategy` with the options the
engine derives from its spec (:func:`tandem.runtime.engine.spec_options`), so the bench
measures exactly what ``tandem run``, the chat app and the server run:

* ``plain``: ``mode="off"``, the baseline every ratio is taken against;
* ``ngram``: model-free drafting (suffix tree + prompt lookup), adaptive length;
* ``auto+L``: ``mode="auto"`` with drafter L (model-free drafting plus the model);
* ``L@k``: drafter L alone at a fixed draft length k (``model`` or ``xvocab`` mode);

where L is ``model`` for a same-vocabulary drafter, ``xvocab`` for one with another
vocabulary, and ``oracle`` for the toy model a cost twin was widened from. The outside
peers are llama-cpp-python's ``Llama`` greedy (``llama``) and with its prompt-lookup
drafter (``llama-lookup``); see :mod:`tandem.app.bench.peers`.

For each repetition, workload and prompt the configurations run back to back in a
rotated order (so a busy machine's slow spells spread over all of them), and each run
is compared with the plain run of the same prompt and repetition: paired decode-rate
ratios, greedy identity, acceptance and tokens per target call
(:mod:`tandem.app.bench.report` summarises them).
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from tandem.app.bench.peers import PEER_NOTE, PEERS, LlamaPeer, RunResult, decode_rate
from tandem.app.bench.workloads import DEFAULT_WORKLOADS, Workload, workload
from tandem.kernels.sampling import Sampler, SamplingParams
from tandem.models.errors import TandemError
from tandem.runtime.backends.llama import LlamaConfig
from tandem.runtime.backends.protocol import Backend
from tandem.runtime.engine import Engine, EngineSpec, open_engine, spec_options
from tandem.runtime.generate import DoneEvent, generate
from tandem.runtime.machine import cpu_cores
from tandem.runtime.speculative.factory import build_strategy, open_draft_backend


@dataclass
class BenchConfig:
    target: Path
    draft: Path | None = None
    """Drafter model: same vocabulary (configs ``auto+model``, ``model@k``) or another
    vocabulary (``auto+xvocab``, ``xvocab@k``)."""
    draft2: Path | None = None
    """A second drafter, typically the cross-vocabulary one next to a same-vocabulary --draft."""
    oracle: Path | None = None
    """The model a cost twin was widened from (configs ``auto+oracle``, ``oracle@k``)."""
    n_tokens: int = 64
    prompts: int = 2
    """Prompts per workload (at most what the workload offers)."""
    reps: int = 1
    lengths: tuple[int, ...] = (4, 8)
    """Fixed draft lengths of the model-drafter configurations."""
    draft_max: int = 8
    """SpecOptions.draft_max of the adaptive configurations."""
    workloads: tuple[str, ...] = DEFAULT_WORKLOADS
    configs: tuple[str, ...] | None = None
    """Configuration names to run (``plain`` always runs); ``None`` = all."""
    families: tuple[str, ...] | None = None
    """Only the configurations of these drafters (ngram, model, xvocab, oracle); ``None`` = all."""
    threads: int | None = None
    ctx: int = 1024
    budget: str | None = None
    """Host memory budget for the planner, as ``tandem run --budget``."""
    kv_type: str | None = None
    """The target's llama.cpp KV type, as ``tandem run --kv-type``."""
    repack: bool = False
    """Tandem's target with llama.cpp's repacked weights, as ``tandem run --repack``."""
    peers: bool = True
    """Run llama-cpp-python plain and with prompt lookup."""
    log: Callable[[str], None] = print
    checkpoint: Callable[[dict], None] | None = None
    """Called with the report so far after each workload (the CLI writes --json then)."""


@dataclass(frozen=True)
class TandemConfig:
    """A Tandem configuration: the SpecOptions it is built with and its drafter's label."""

    name: str
    mode: str
    drafter: str | None = None
    draft_length: int | None = None


@dataclass
class Run:
    config: str
    workload: str
    prompt: int
    rep: int
    result: RunResult


@dataclass
class Drafter:
    label: str
    path: Path
    backend: Backend
    same_vocab: bool


def tandem_configs(drafters: Sequence[Drafter], lengths: Sequence[int]) -> list[TandemConfig]:
    """Every Tandem configuration the drafters allow, ``plain`` first."""
    configs = [TandemConfig("plain", "off"), TandemConfig("ngram", "ngram")]
    for d in drafters:
        configs.append(TandemConfig(f"auto+{d.label}", "auto", d.label))
        fixed_mode = "model" if d.same_vocab else "xvocab"
        configs += [TandemConfig(f"{d.label}@{k}", fixed_mode, d.label, k) for k in lengths]
    return configs


def select(names: list[str], wanted: Sequence[str] | None) -> list[str]:
    """``names`` restricted to ``wanted`` (plain kept first); unknown names are an error."""
    if wanted is None:
        return names
    unknown = [w for w in wanted if w not in names]
    if unknown:
        raise TandemError(f"Unknown bench configuration {unknown[0]!r}; this run offers {', '.join(names)}.")
    return ["plain", *(n for n in names if n in wanted and n != "plain")]


def family(name: str) -> str:
    """The drafter a configuration name uses: ``auto+model`` and ``model@4`` -> ``model``."""
    return name.split("@")[0].removeprefix("auto+")


def select_families(names: list[str], families: Sequence[str] | None) -> list[str]:
    """``names`` restricted to plain, the peers and the configurations of ``families``."""
    if families is None:
        return names
    return [n for n in names if n == "plain" or n in PEERS or family(n) in families]


def rotated(names: list[str], shift: int) -> list[str]:
    shift %= len(names)
    return names[shift:] + names[:shift]


def run_tandem(target: Backend, prompt: list[int], config: TandemConfig, draft: Backend | None, n: int, *,
               spec: EngineSpec, shared_suffix_cache: bool) -> RunResult:
    """One greedy generation of ``n`` tokens with a freshly built strategy (``spec``'s
    options, with this configuration's mode and draft length)."""
    started = time.perf_counter()
    run_spec = replace(spec, draft_mode=config.mode, draft_len=config.draft_length,
                       suffix_memory="process" if shared_suffix_cache else "request")
    strategy = build_strategy(target, draft if config.drafter else None, spec_options(run_spec))
    setup_s = time.perf_counter() - started
    try:
        done, cpu_first = None, None
        for event in generate(target, prompt, Sampler(SamplingParams.greedy_params()), strategy=strategy,
                              max_tokens=n, stop_at_eog=False):
            if cpu_first is None:
                cpu_first = time.process_time()
            done = event
        cpu_s = time.process_time() - (cpu_first or 0.0)
        describe = strategy.describe()
    finally:
        strategy.close()
    assert isinstance(done, DoneEvent)
    s = done.stats
    return RunResult(done.tokens, s.tokens_per_s, decode_rate(len(done.tokens), cpu_s), s.target_calls,
                     s.drafted_tokens, s.accepted_tokens, setup_s, describe)


def open_drafters(target: Backend, cfg: BenchConfig, threads: int, opened: list[Backend | Engine]) -> list[Drafter]:
    """Open each drafter once (shared by its configurations) and label it by vocabulary."""
    from tandem.runtime.speculative.drafters.model import same_vocabulary

    drafters: list[Drafter] = []
    for path, role in ((cfg.draft, "draft"), (cfg.draft2, "draft"), (cfg.oracle, "oracle")):
        if path is None:
            continue
        backend = open_draft_backend(target, path, llama_config=LlamaConfig(n_ctx=target.n_ctx, n_threads=threads))
        opened.append(backend)
        same = same_vocabulary(target, backend)
        label = "oracle" if role == "oracle" else ("model" if same else "xvocab")
        taken = {d.label for d in drafters}
        if label in taken:
            label = next(f"{label}{i}" for i in range(2, 10) if f"{label}{i}" not in taken)
        drafters.append(Drafter(label, path, backend, same))
    return drafters


def machine() -> dict:
    """What the figures were measured on (the load average says how busy it was)."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": model, "cpus": os.cpu_count(), "load_start": list(os.getloadavg())}


def check_room(target: Backend, work: dict[str, Workload], n: int) -> None:
    longest = max(len(p) for w in work.values() for p in w.prompts)
    if longest + n > target.n_ctx:
        raise TandemError(f"A bench prompt of {longest} tokens plus {n} generated does not fit the "
                          f"{target.n_ctx}-token context: raise --ctx or lower -n.")


def warm_up(target: Backend, work: dict[str, Workload], names: list[str], run_one: Callable, log) -> dict[str, float]:
    """One short untimed run of every configuration (the first touch of each model's
    weights, any cached calibration), and the repetitive workload's earlier requests.
    Returns each configuration's build time on this first use."""
    first = next(iter(work.values())).prompts[0]
    setup: dict[str, float] = {}
    for name in names:
        started = time.perf_counter()
        res = run_one(name, first, 4, False)
        setup[name] = res.setup_s
        log(f"warm-up {name:14s} build {res.setup_s:6.2f} s, run {time.perf_counter() - started:6.2f} s")
    for w in work.values():
        if w.shared_suffix_cache:  # the earlier request the repetitive workload re-asks
            for prompt in w.prompts:
                run_one("ngram", prompt, None, True)
    return setup


def run_bench(cfg: BenchConfig) -> dict:
    from tandem.app.bench.report import summarize

    threads = cfg.threads or cpu_cores()
    spec = EngineSpec(cfg.target, draft_mode="off", draft_max=cfg.draft_max, budget=cfg.budget, threads=threads,
                      n_ctx=cfg.ctx, kv_type=cfg.kv_type, engine="llama.cpp", repack=cfg.repack)
    engine = open_engine(spec)
    target = engine.target
    opened: list[Backend | Engine] = [engine]
    peers: dict[str, LlamaPeer] = {}
    try:
        work = {name: workload(target, name, cfg.prompts) for name in cfg.workloads}
        check_room(target, work, cfg.n_tokens)
        drafters = open_drafters(target, cfg, threads, opened)
        by_label = {d.label: d.backend for d in drafters}
        configs = {c.name: c for c in tandem_configs(drafters, cfg.lengths)}
        offered = select_families(list(configs) + (list(PEERS) if cfg.peers else []), cfg.families)
        names = select(offered, cfg.configs)
        for name in names:
            if name in PEERS:
                peers[name] = LlamaPeer(cfg.target, n_ctx=target.n_ctx, threads=threads,
                                        lookup=name == "llama-lookup")

        def run_one(name: str, prompt: list[int], n: int | None, shared: bool) -> RunResult:
            n = n or cfg.n_tokens
            if name in peers:
                return peers[name].run(prompt, n)
            c = configs[name]
            return run_tandem(target, prompt, c, by_label.get(c.drafter or ""), n, spec=spec,
                              shared_suffix_cache=shared)

        info = machine()
        cfg.log(f"{target.name}: {len(names)} configurations, {threads} thread(s), context {target.n_ctx}, "
                f"load average {info['load_start'][0]:.2f}")
        cold_setup = warm_up(target, work, names, run_one, cfg.log)
        runs: list[Run] = []

        def report() -> dict:
            info["load_end"] = list(os.getloadavg())
            out = summarize(runs, target, names)
            out["config"] = settings
            out["machine"] = info
            return out

        settings = {
            "target": str(cfg.target), "n_tokens": cfg.n_tokens, "prompts": cfg.prompts, "reps": cfg.reps,
            "threads": threads, "ctx": target.n_ctx, "lengths": list(cfg.lengths), "draft_max": cfg.draft_max,
            "drafters": {d.label: {"path": str(d.path), "same_vocab": d.same_vocab} for d in drafters},
            "tandem_backend": ("LlamaConfig(exact=True, repack=True): weights repacked, verify calls of at most 3 tokens"
                               if cfg.repack else "LlamaConfig(exact=True): weights not repacked"),
            "kv_type": engine.plan.target.type_k if engine.plan else None,
            "peers": PEER_NOTE if peers else None,
            "cold_setup_s": cold_setup,
        }
        # workload by workload (repetitions alternate within one), so a long run that is
        # stopped early still has whole workloads to show (``checkpoint``)
        for wl in work.values():
            for rep in range(cfg.reps):
                for pi, prompt in enumerate(wl.prompts):
                    for name in rotated(names, rep * len(wl.prompts) + pi):
                        res = run_one(name, prompt, None, wl.shared_suffix_cache)
                        runs.append(Run(name, wl.name, pi, rep, res))
                        cfg.log(f"rep {rep} {wl.name:10s} p{pi} {name:14s} {res.tokens_per_s:7.2f} tok/s "
                                f"cpu {res.cpu_tokens_per_s:7.2f} calls {res.target_calls:4d} "
                                f"acc {res.accepted}/{res.drafted}")
            if cfg.checkpoint is not None:
                cfg.checkpoint(report())
        return report()
    finally:
        for peer in peers.values():
            peer.close()
        for b in reversed(opened):
            b.close()
