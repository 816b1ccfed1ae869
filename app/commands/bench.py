"""`tandem bench`: speed benchmarks that run baseline and candidate alternately in one process.

Default: plain decoding vs each speculative mode. ``--autocomplete``: k superposed drafts
vs k sampled runs vs one k-sequence batch. ``--structured``: schema-constrained
extraction, plain constrained decoding vs forced runs and speculation. ``--ar-overhead``: Tandem's plain decoding loop
vs llama-cpp-python's own ``Llama.generate``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from tandem.app.bench.workloads import DEFAULT_WORKLOADS, WORKLOADS
from tandem.app.commands.engine_flags import MODEL_HELP
from tandem.errors import TandemError
from tandem.models.extras import require
from tandem.models.store import resolve_model
from tandem.runtime.choices import LLAMA_KV_TYPES
from tandem.runtime.planning.hardware import parse_size


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("draft lengths must be positive integers")
    return values


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="speed benchmarks, baseline vs candidate in one run (speculative, --autocomplete, --ar-overhead)")
    p.add_argument("-m", "--model", required=True, help="the target: " + MODEL_HELP)
    p.add_argument("--draft", default=None, help="drafter model (same or other vocabulary): configs auto+model, model@K "
                   "(or auto+xvocab, xvocab@K)")
    p.add_argument("--draft2", default=None, help="a second drafter, e.g. a cross-vocabulary one next to a same-vocabulary --draft")
    p.add_argument("--oracle", default=None,
                   help="oracle drafter: the model the target is a cost twin of (shows the ceiling)")
    p.add_argument("-n", "--max-tokens", type=int, default=64, help="tokens generated per run")
    p.add_argument("--prompts", type=int, default=None,
                   help="prompts per workload (default 2; 2-3 real ones each); --ar-overhead: default all 3 (or 4)")
    p.add_argument("--reps", type=int, default=None,
                   help="repetitions (configurations alternate, rotated, within each; default 1, --gpu: 3)")
    p.add_argument("--lengths", type=_ints, default=(4, 8), help="fixed draft lengths of the model drafters, e.g. 4,8")
    p.add_argument("--draft-max", type=int, default=8, help="longest draft of the adaptive configurations")
    p.add_argument("--configs", type=_names, default=None,
                   help="only these configurations (plain always runs), e.g. plain,ngram,auto+model,model@4,llama-lookup")
    p.add_argument("--drafters", type=_names, default=None,
                   help="only the configurations of these drafters: ngram, model, xvocab, oracle (plus plain and peers)")
    p.add_argument("--workloads", type=_names, default=DEFAULT_WORKLOADS,
                   help=f"comma-separated: {', '.join(WORKLOADS)} (the last three are for toy story models)")
    p.add_argument("--threads", type=int, default=None, help="threads of every engine (default: all cores)")
    p.add_argument("--ctx", type=int, default=None, help="context size (default 1024; --ar-overhead: 1024)")
    p.add_argument("--budget", default=None, help="host memory for the memory planner, as `tandem run --budget`")
    p.add_argument("--vram", default=None,
                   help="with --gpu: a GPU budget the target does not fit whole, e.g. 3GiB: also time each placement "
                        "the planner compares (partial offload, target on CPU threads, quantized KV) against plain "
                        "llama.cpp partial offload at that budget")
    p.add_argument("--kv-type", choices=LLAMA_KV_TYPES, default=None,
                   help="the target's llama.cpp KV cache type, as `tandem run --kv-type` (default: f16 unless "
                        "the budget needs less)")
    p.add_argument("--repack", action=argparse.BooleanOptionalAction, default=None,
                   help="Tandem's target with llama.cpp's repacked weights (still exact), or with --no-repack the "
                        "weights as stored, as `tandem run --repack/--no-repack` (default: this machine's choice, "
                        "as users get it)")
    p.add_argument("--no-peers", "--no-llama-baseline", dest="no_peers", action="store_true",
                   help="skip llama-cpp-python (plain and prompt lookup)")
    p.add_argument("--json", dest="json_file", default=None, metavar="FILE", help="write the figures as JSON")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="draw the figures (PNG)")
    modes = p.add_mutually_exclusive_group()
    modes.add_argument("--autocomplete", action="store_true",
                       help="k autocomplete drafts: superposed vs k sampled runs vs one k-sequence batch")
    modes.add_argument("--ar-overhead", action="store_true",
                       help="Tandem's plain decoding vs llama.cpp's own decode and llama-cpp-python's Llama.generate")
    modes.add_argument("--structured", action="store_true",
                       help="schema-constrained extraction: plain constrained decoding vs forced runs vs speculation "
                            "(with --draft) + forced runs vs llama-cpp-python's grammar decoding")
    modes.add_argument("--predicted", action="store_true",
                       help="code edits with the code sent as the prediction (OpenAI's Predicted Outputs): plain vs "
                            "speculation without and with it vs llama-cpp-python plain and prompt lookup")
    modes.add_argument("--cost-curve", action="store_true",
                       help="the target's verify-cost curve c(k) (exact vs fast llama.cpp) and each drafter's cost per token")
    modes.add_argument("--gpu", action="store_true",
                       help="the GPU comparisons in one run, every model on the GPU when llama.cpp lists one: plain "
                            "vs llama-cpp-python (decode, prefill), c(k) and drafter cost, edit/extract end to end, "
                            "modeled speedups (--acceptance)")
    modes.add_argument("--record-acceptance", default=None, metavar="FILE",
                       help="record each configuration's rounds (drafted, accepted) on the real models as JSON, "
                            "for --gpu --acceptance FILE")
    p.add_argument("--acceptance", default=None, metavar="FILE",
                   help="with --gpu: acceptance recorded by --record-acceptance, priced on this device (modeled)")
    p.add_argument("--k", type=_ints, default=(2, 3, 5), help="with --autocomplete: draft counts (default 2,3,5)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.acceptance and not args.gpu:
        raise TandemError("--acceptance goes with --gpu (it prices recorded acceptance on this device).")
    if args.vram and not args.gpu:
        raise TandemError("--vram goes with --gpu (the GPU budget its placements are compared at).")
    if args.reps is None:
        args.reps = 3 if args.gpu else 1
    if args.gpu:
        return run_gpu(args)
    if args.record_acceptance:
        return run_record_acceptance(args)
    if args.autocomplete:
        return run_autocomplete(args)
    if args.ar_overhead:
        return run_ar_overhead(args)
    if args.cost_curve:
        return run_cost_curve(args)
    if args.structured:
        return run_structured_bench(args)
    if args.predicted:
        return run_predicted_bench(args)
    # local: `tandem --help` imports every command module; this loads only when the command runs
    from tandem.app.bench.report import format_report, markdown_table, plot_report
    from tandem.app.bench.runner import BenchConfig, run_bench

    bad = [w for w in args.workloads if w not in WORKLOADS]
    if bad or not args.workloads:
        raise TandemError(f"Unknown workload {bad[0] if bad else ''!r}; choose from {', '.join(WORKLOADS)}.")
    prompts = 2 if args.prompts is None else args.prompts
    if args.max_tokens < 2 or prompts < 1 or args.reps < 1:
        raise TandemError("--max-tokens must be at least 2, --prompts and --reps at least 1.")
    if args.draft_max < 1 or (args.threads is not None and args.threads < 1) or (args.ctx is not None and args.ctx < 16):
        raise TandemError("--draft-max and --threads must be at least 1, --ctx at least 16.")
    if args.plot:
        require("--plot", "plots", "matplotlib")
        _check_writable(Path(args.plot))
    if args.json_file:
        _check_writable(Path(args.json_file))
    cfg = BenchConfig(
        target=resolve_model(args.model),
        draft=resolve_model(args.draft) if args.draft else None,
        draft2=resolve_model(args.draft2) if args.draft2 else None,
        oracle=resolve_model(args.oracle) if args.oracle else None,
        n_tokens=args.max_tokens, prompts=prompts, reps=args.reps, lengths=args.lengths,
        draft_max=args.draft_max, workloads=args.workloads, configs=args.configs, families=args.drafters,
        threads=args.threads,
        ctx=args.ctx or 1024, budget=args.budget, kv_type=args.kv_type, repack=args.repack, peers=not args.no_peers,
        log=lambda line: print(line, file=sys.stderr, flush=True),
        checkpoint=(lambda partial: _write_json(Path(args.json_file), partial)) if args.json_file else None,
    )
    report = run_bench(cfg)
    print(format_report(report))
    print()
    print(markdown_table(report))
    if args.json_file:
        _write_json(Path(args.json_file), report)
    if args.plot:
        plot_report(report, args.plot)
    return 0


def _write_json(path: Path, report: dict) -> None:
    path.write_text(json.dumps(report, indent=1, default=str))


def _check_writable(path: Path) -> None:
    """Fail before a long run, not after it, when an output file cannot be written."""
    if not path.parent.is_dir():
        raise TandemError(f"Cannot write {path}: the folder {path.parent} does not exist.")


def _plain_and(known: Sequence[str], peers: Sequence[str], args: argparse.Namespace) -> list[str]:
    """The configurations a comparison against ``plain`` runs: ``--configs`` (each one of
    ``known``, else an error naming it) or all of them, ``plain`` first, without the
    llama-cpp-python ``peers`` under ``--no-peers``."""
    configs = [c for c in known if c not in peers or not args.no_peers]
    if args.configs:
        unknown = [c for c in args.configs if c not in known]
        if unknown:
            raise TandemError(f"Unknown configuration {unknown[0]!r}; choose from {', '.join(known)}.")
        configs = ["plain", *[c for c in configs if c in args.configs and c != "plain"]]
    return configs


def _print_comparison(report: dict, markdown_table: Callable[[dict], str], args: argparse.Namespace) -> None:
    """A comparison against ``plain`` (:mod:`tandem.app.bench.alternating`'s reports): what
    ran, on what load, its table, and the whole report under ``--json``."""
    draft = Path(report["draft"]).name if report["draft"] else "none"
    print(f"model {Path(report['target']).name}, drafter {draft}, {report['threads']} threads, "
          f"{report['prompts']} prompts x {report['reps']} reps, {report['max_tokens']} tokens, "
          f"load average {report['load_start'][0]:.1f} -> {report['load_end'][0]:.1f}")
    print(markdown_table(report))
    if args.json_file:
        _write_json(Path(args.json_file), report)


def run_structured_bench(args: argparse.Namespace) -> int:
    # local: `tandem --help` imports every command module; this loads only when the command runs
    from tandem.app.bench.structured import (
        CONFIGS,
        PROMPTS,
        StructuredConfig,
        markdown_table,
        run_structured,
    )
    from tandem.runtime.machine import cpu_cores

    prompts = len(PROMPTS) if args.prompts is None else args.prompts
    if args.reps < 1 or not 1 <= prompts <= len(PROMPTS):
        raise TandemError(f"--reps must be at least 1, --prompts 1..{len(PROMPTS)}.")
    configs = _plain_and(CONFIGS, ("llama-grammar",), args)
    if args.json_file:
        _check_writable(Path(args.json_file))
    cfg = StructuredConfig(resolve_model(args.model), resolve_model(args.draft) if args.draft else None,
                           threads=args.threads or cpu_cores(), ctx=args.ctx or 1024, prompts=prompts,
                           reps=args.reps, configs=configs, log=lambda s: print(s, file=sys.stderr, flush=True))
    _print_comparison(run_structured(cfg), markdown_table, args)
    return 0


def run_predicted_bench(args: argparse.Namespace) -> int:
    # local: `tandem --help` imports every command module; this loads only when the command runs
    from tandem.app.bench.predicted import (
        CONFIGS,
        PEERS,
        PredictedConfig,
        markdown_table,
        run_predicted,
    )
    from tandem.app.bench.workloads import EDIT
    from tandem.runtime.machine import cpu_cores

    prompts = len(EDIT) if args.prompts is None else args.prompts
    if args.reps < 1 or args.max_tokens < 2 or not 1 <= prompts <= len(EDIT):
        raise TandemError(f"--reps must be at least 1, --max-tokens at least 2, --prompts 1..{len(EDIT)}.")
    configs = _plain_and(CONFIGS, PEERS, args)
    if args.json_file:
        _check_writable(Path(args.json_file))
    cfg = PredictedConfig(resolve_model(args.model), resolve_model(args.draft) if args.draft else None,
                          threads=args.threads or cpu_cores(), ctx=args.ctx or 2048, max_tokens=args.max_tokens,
                          prompts=prompts, reps=args.reps, configs=configs,
                          log=lambda s: print(s, file=sys.stderr, flush=True))
    _print_comparison(run_predicted(cfg), markdown_table, args)
    return 0


def run_autocomplete(args: argparse.Namespace) -> int:
    # local: `tandem --help` imports every command module; this loads only when the command runs
    from tandem.app.bench.autocomplete import PROMPTS, markdown_table, run_bench
    from tandem.runtime.backends.llama import LlamaCppBackend
    from tandem.runtime.engine.builder import open_engine
    from tandem.runtime.engine.spec import EngineSpec

    if max(args.k) > 16:
        raise TandemError("--k values must be between 1 and 16.")
    prompts = 2 if args.prompts is None else args.prompts
    if args.max_tokens < 1 or args.reps < 1 or not 1 <= prompts <= len(PROMPTS):
        raise TandemError(f"--max-tokens and --reps must be at least 1, --prompts 1..{len(PROMPTS)}.")
    # The target as `tandem serve` opens it for /infill (planned, this machine's kernels).
    spec = EngineSpec(resolve_model(args.model), draft_mode="off", n_ctx=args.ctx or 256, threads=args.threads)
    with open_engine(spec) as engine:
        if not isinstance(engine.target, LlamaCppBackend):
            raise TandemError("--autocomplete compares decoders inside llama.cpp: give it a GGUF model.")
        result = run_bench(engine.target, sorted(set(args.k)), args.max_tokens, args.reps, PROMPTS[:prompts],
                           log=lambda s: print(s, file=sys.stderr, flush=True))
    print(f"model {result['model']}, {result['max_tokens']} tokens per draft, medians of "
          f"{result['repeats']} x {result['prompts']} prompts")
    print(markdown_table(result))
    if args.json_file:
        Path(args.json_file).write_text(json.dumps(result, indent=1))
    return 0


def run_ar_overhead(args: argparse.Namespace) -> int:
    # local: `tandem --help` imports every command module; this loads only when the command runs
    from tandem.app.bench.ar_overhead import N_CTX, measure_overhead

    if args.max_tokens < 2 or args.reps < 1 or (args.prompts is not None and args.prompts < 1):
        raise TandemError("--max-tokens must be at least 2, --prompts and --reps at least 1.")
    result = measure_overhead(resolve_model(args.model), tokens=args.max_tokens, rounds=args.reps,
                              threads=args.threads, prompts=args.prompts, n_ctx=args.ctx or N_CTX)
    print(f"{result.model} (vocabulary {result.n_vocab:,}, {result.threads} thread(s), {result.tokens} tokens, "
          f"medians of {result.rounds} round(s)):\n"
          f"  Tandem            {result.tandem_tps:8.2f} tok/s  {result.tandem_ms_per_token:7.2f} ms/token\n"
          f"  llama.cpp C loop  {result.native_tps:8.2f} tok/s  {result.native_ms_per_token:7.2f} ms/token "
          f"(llama.cpp's own decode {result.native_eval_ms_per_token:.2f} ms/token)\n"
          f"  llama-cpp-python  {result.llama_tps:8.2f} tok/s\n"
          f"  Tandem / C loop {result.native_ratio:.3f}, Tandem / llama-cpp-python {result.ratio:.3f} (medians of "
          f"per-pair ratios); Tandem's per-token overhead {result.overhead_ms_per_token:.2f} ms; "
          f"identical to the C loop: {result.identical}, to llama-cpp-python: {result.llama_identical}")
    if args.json_file:
        Path(args.json_file).write_text(json.dumps(result.as_dict(), indent=1))
    return 0


def run_cost_curve(args: argparse.Namespace) -> int:
    # local: `tandem --help` imports every command module; this loads only when the command runs
    from tandem.app.bench.cost_curve import format_costs, measure_costs

    if args.reps < 1 or args.draft_max < 1:
        raise TandemError("--reps and --draft-max must be at least 1.")
    drafters = [resolve_model(d) for d in (args.draft, args.draft2) if d]
    result = measure_costs(resolve_model(args.model), drafters=drafters, threads=args.threads,
                           k_max=args.draft_max, reps=args.reps, n_ctx=args.ctx or 1024)
    print(format_costs(result))
    if args.json_file:
        _write_json(Path(args.json_file), result.as_dict())
    return 0


def run_gpu(args: argparse.Namespace) -> int:
    # local: `tandem --help` imports every command module; this loads only when the command runs
    from tandem.app.bench import acceptance_traces
    from tandem.app.bench.gpu import GpuBenchConfig, format_gpu, plot_gpu, run_gpu_bench

    if args.max_tokens < 2 or args.reps < 1 or (args.prompts is not None and args.prompts < 1):
        raise TandemError("--max-tokens must be at least 2, --prompts and --reps at least 1.")
    if args.plot:
        require("--plot", "plots", "matplotlib")
        _check_writable(Path(args.plot))
    if args.json_file:
        _check_writable(Path(args.json_file))
    if args.vram:
        parse_size(args.vram)  # a bad size is refused before the long sections run
    record = acceptance_traces.load(Path(args.acceptance)) if args.acceptance else None
    cfg = GpuBenchConfig(resolve_model(args.model), resolve_model(args.draft) if args.draft else None, record,
                         n_tokens=args.max_tokens, reps=args.reps,
                         prompts=2 if args.prompts is None else args.prompts, threads=args.threads,
                         ctx=args.ctx or 1024, vram=args.vram, budget=args.budget,
                         log=lambda line: print(line, file=sys.stderr, flush=True))
    result = run_gpu_bench(cfg)
    print(format_gpu(result))
    if args.json_file:
        _write_json(Path(args.json_file), result)
    if args.plot:
        plot_gpu(result, args.plot)
    return 0


def run_record_acceptance(args: argparse.Namespace) -> int:
    # local: `tandem --help` imports every command module; this loads only when the command runs
    from tandem.app.bench import acceptance_traces
    from tandem.app.bench.runner import BenchConfig

    bad = [w for w in args.workloads if w not in WORKLOADS]
    if bad:
        raise TandemError(f"Unknown workload {bad[0]!r}; choose from {', '.join(WORKLOADS)}.")
    out = Path(args.record_acceptance)
    _check_writable(out)
    prompts = 2 if args.prompts is None else args.prompts
    if args.max_tokens < 2 or prompts < 1:
        raise TandemError("--max-tokens must be at least 2, --prompts at least 1.")
    cfg = BenchConfig(target=resolve_model(args.model), draft=resolve_model(args.draft) if args.draft else None,
                      n_tokens=args.max_tokens, prompts=prompts, lengths=args.lengths, draft_max=args.draft_max,
                      workloads=args.workloads, configs=args.configs, families=args.drafters, threads=args.threads,
                      ctx=args.ctx or 1024, budget=args.budget, kv_type=args.kv_type, repack=args.repack, peers=False,
                      log=lambda line: print(line, file=sys.stderr, flush=True))
    record = acceptance_traces.record_acceptance(cfg)
    acceptance_traces.save(record, out)
    print(f"recorded {sum(len(t) for t in record['workloads'].values())} workload x configuration traces of "
          f"{record['target']} ({out.stat().st_size / 1024:.0f} KiB) in {out}")
    return 0
