"""`tandem bench`: plain Tandem vs every drafting mode vs llama-cpp-python, same prompts.

Everything runs in one process on one target file. Every Tandem configuration is an
engine opened by the builder every front end uses
(:func:`tandem.runtime.engine.builder.open_engine`: planned, placed, exact configuration,
``--kv-type`` and ``--budget`` as in ``tandem run``), from the :class:`EngineSpec` a user
would give for it, so the bench measures exactly what ``tandem run``, the chat app and
the server run. Each reply starts a fresh strategy from its engine
(:meth:`~tandem.runtime.engine.builder.Engine.fresh_strategy`), so replies do not depend on the
order they ran in:

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
from tandem.app.bench.report import summarize
from tandem.app.bench.workloads import DEFAULT_WORKLOADS, Workload, workload
from tandem.errors import TandemError
from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.backends.protocol import Backend
from tandem.runtime.engine.builder import Engine, open_engine
from tandem.runtime.engine.spec import EngineSpec
from tandem.runtime.generate import DoneEvent, generate
from tandem.runtime.machine import cpu_cores
from tandem.runtime.speculative.drafters.model import same_vocabulary


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
    repack: bool | None = None
    """Tandem's target with llama.cpp's repacked weights (``True``) or as stored
    (``False``), as ``tandem run --repack/--no-repack``; ``None``: this machine's choice
    (:mod:`tandem.runtime.backends.llama_kernels`), as users get it."""
    peers: bool = True
    """Run llama-cpp-python plain and with prompt lookup."""
    log: Callable[[str], None] = print
    checkpoint: Callable[[dict], None] | None = None
    """Called with the report so far after each workload (the CLI writes --json then)."""


SAME_ENGINE_MODES = {"plain": "off", "ngram": "ngram"}
"""Configurations run on one engine with only the draft mode changed: that of the first
drafter when one is given, so plain decoding, model-free drafting and ``auto`` decode on
the very same weights. (Repacked weights are a copy per loaded model, and two copies of
one file measured 10 % apart in one process, which a ratio between engines would show.)"""


def engines_in(configs: dict[str, Engine]) -> list[Engine]:
    """Each engine once, in the order opened."""
    return list({id(e): e for e in configs.values()}.values())


@dataclass
class Run:
    config: str
    workload: str
    prompt: int
    rep: int
    result: RunResult


@dataclass
class Drafter:
    """A drafter model of the bench: its configurations' label (``model``, ``xvocab``,
    ``oracle``) and whether it shares the target's vocabulary."""

    label: str
    path: Path
    same_vocab: bool


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


def run_tandem(engine: Engine, prompt: list[int], n: int, *, shared_suffix_cache: bool,
               mode: str | None = None) -> RunResult:
    """One greedy generation of ``n`` tokens with a fresh strategy from ``engine`` (what
    model-free drafting learns from: the process's earlier requests when
    ``shared_suffix_cache``, else this request alone; ``mode``: another draft mode than
    the engine's, ``off`` for plain decoding on the same backends)."""
    started = time.perf_counter()
    changes = {"mode": mode} if mode is not None else {}
    strategy = engine.fresh_strategy(suffix_memory="process" if shared_suffix_cache else "request", **changes)
    setup_s = time.perf_counter() - started
    try:
        done, cpu_first = None, None
        for event in generate(engine.target, prompt, Sampler(SamplingParams.greedy_params()), strategy=strategy,
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


def wanted(cfg: BenchConfig, name: str) -> bool:
    """Whether ``--configs`` and ``--drafters`` leave configuration ``name`` in."""
    return bool(select_families([name], cfg.families)) and (cfg.configs is None or name in ("plain", *cfg.configs))


def open_configs(base: EngineSpec, cfg: BenchConfig, log: Callable[[str], None]) -> tuple[dict[str, Engine], list[Drafter]]:
    """An engine per Tandem configuration asked for, opened as a user's spec for it would
    be, ``plain`` and ``ngram`` first (both on the first drafter's engine, with its draft
    mode changed: :data:`SAME_ENGINE_MODES`), and the drafters labelled by vocabulary (each
    one's ``auto`` engine tells). On failure every engine opened so far is closed."""
    engines: dict[str, Engine] = {}
    drafters: list[Drafter] = []
    shared: Engine | None = None
    try:
        for path, role in ((cfg.draft, "draft"), (cfg.draft2, "draft"), (cfg.oracle, "oracle")):
            if path is None:
                continue
            auto = open_engine(replace(base, drafter=path, draft_mode="auto"))
            if auto.drafter_backend is None:
                auto.close()
                raise TandemError(f"The memory planner left the drafter {path.name} out: "
                                  + "; ".join(auto.notes or ["raise --budget"]))
            same = same_vocabulary(auto.target, auto.drafter_backend)
            label = "oracle" if role == "oracle" else ("model" if same else "xvocab")
            taken = {d.label for d in drafters}
            if label in taken:
                label = next(f"{label}{i}" for i in range(2, 10) if f"{label}{i}" not in taken)
            drafters.append(Drafter(label, path, same))
            shared = shared or auto
            if wanted(cfg, f"auto+{label}"):
                engines[f"auto+{label}"] = auto
            elif auto is not shared:
                auto.close()
            for k in cfg.lengths:
                if wanted(cfg, f"{label}@{k}"):
                    fixed = replace(base, drafter=path, draft_mode="model" if same else "xvocab", draft_len=k)
                    engines[f"{label}@{k}"] = open_engine(fixed)
        shared = shared or open_engine(replace(base, draft_mode="off"))
        first = {name: shared for name in SAME_ENGINE_MODES if wanted(cfg, name)}
        engines = {**first, **engines}
        for name, engine in engines.items():
            for note in engine.notes:
                log(f"{name}: {note}")
        return engines, drafters
    except BaseException:
        for engine in reversed(engines_in({**engines, **({"shared": shared} if shared else {})})):
            engine.close()
        raise


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
    threads = cfg.threads or cpu_cores()
    spec = EngineSpec(cfg.target, draft_mode="off", draft_max=cfg.draft_max, budget=cfg.budget, threads=threads,
                      n_ctx=cfg.ctx, kv_type=cfg.kv_type, engine="llama.cpp", repack=cfg.repack)
    engines, drafters = open_configs(spec, cfg, cfg.log)
    engine = engines["plain"]
    target = engine.target
    repacked = engine.kernels.repack if engine.kernels is not None else bool(cfg.repack)
    peers: dict[str, LlamaPeer] = {}
    try:
        work = {name: workload(target, name, cfg.prompts) for name in cfg.workloads}
        check_room(target, work, cfg.n_tokens)
        offered = select_families(list(engines) + (list(PEERS) if cfg.peers else []), cfg.families)
        names = select(offered, cfg.configs)
        for name in names:
            if name in PEERS:
                peers[name] = LlamaPeer(cfg.target, n_ctx=target.n_ctx, threads=threads,
                                        lookup=name == "llama-lookup")

        def run_one(name: str, prompt: list[int], n: int | None, shared: bool) -> RunResult:
            n = n or cfg.n_tokens
            if name in peers:
                return peers[name].run(prompt, n)
            return run_tandem(engines[name], prompt, n, shared_suffix_cache=shared, mode=SAME_ENGINE_MODES.get(name))

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
                               if repacked else "LlamaConfig(exact=True): weights not repacked"),
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
        for opened in reversed(engines_in(engines)):
            opened.close()
