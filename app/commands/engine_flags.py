"""The flags that say how a model is opened, shared by `run`, `chat`, `serve`, `bench`
and `plan`, with one set of defaults (README, "Using it"), and the
:class:`~tandem.runtime.engine.builder.EngineSpec` they describe.

Each command adds the groups that apply to it (:func:`add_engine_flags`); everything
goes through :func:`spec_from_args` to :func:`tandem.runtime.engine.builder.open_engine`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import platformdirs

from tandem.errors import TandemError
from tandem.models.store import resolve_model
from tandem.runtime.backends.rpc_probe import parse_endpoints
from tandem.runtime.choices import (
    DEVICE_CHOICES,
    ENGINES,
    LLAMA_KV_TYPES,
    MODES,
    OFFLOAD_CHOICES,
    SUFFIX_MEMORIES,
)
from tandem.runtime.engine.spec import EngineSpec
from tandem.runtime.kv.config import PRESETS
from tandem.runtime.machine import cpu_cores
from tandem.runtime.moe.config import EVICTIONS, MoeOffloadSpec

KV_COMPRESS_CHOICES = ("none", *PRESETS)

MODEL_HELP = "GGUF file, a name from `tandem models`, or the reference it was pulled with (OWNER/REPO:Q4_K_M)"
"""``-m``'s help in every command that opens a model: each resolves it the same way
(:func:`tandem.models.store.resolve_model`)."""


def add_engine_flags(p: argparse.ArgumentParser, *, ctx_default: int | None = None) -> None:
    """``--ctx --threads --budget --vram``, the speculative-decoding group (``--draft
    --draft-mode --draft-max --draft-len --fast-verify --suffix-memory --placement``) and the engine and
    memory techniques (``--engine --device --kv-type --offload --kv-compress --moe-offload ...``)."""
    g = p.add_argument_group("model and memory")
    g.add_argument("-c", "--ctx", type=int, default=ctx_default,
                   help="context length (default: " + (f"{ctx_default}" if ctx_default else
                                                        "the model's, at most 4096, shrunk to fit the budget") + ")")
    g.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: every core)")
    g.add_argument("--budget", default=None, help="host memory the process may use, e.g. 6GiB (default: 85%% of "
                   "available RAM); the memory planner fits target + drafter under it (see `tandem plan`)")
    g.add_argument("--vram", default=None, help="GPU memory it may use, e.g. 4GiB (default: 92%% of free)")
    g.add_argument("--rpc", default=None, metavar="HOST:PORT[,...]",
                   help="split the target over llama.cpp RPC servers (`tandem rpc-server` on each; the drafter "
                        "stays here; default: `rpc` in config.toml, `off` ignores it)")
    add_draft_flags(p)
    add_technique_flags(p)


def add_draft_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (lossless)")
    g.add_argument("--draft", default=None, metavar="DRAFTER",
                   help="drafter model: GGUF file or a name from `tandem models` (any vocabulary)")
    g.add_argument("--draft-mode", choices=MODES, default="auto",
                   help="auto (default): model-free drafting (suffix tree, prompt lookup) always, then the "
                        "drafter if one is named (same- or cross-vocabulary), adaptive length, switched off "
                        "when it does not pay; model/xvocab: the drafter only; ngram: model-free only; off: plain")
    g.add_argument("--draft-max", type=int, default=8, metavar="N", help="most tokens drafted per round (default 8)")
    g.add_argument("--draft-len", type=int, default=None, metavar="K",
                   help="fixed draft length instead of the adaptive policy")
    g.add_argument("--fast-verify", action="store_true",
                   help="verify long drafts in one call with llama.cpp's fastest CPU kernels: faster on "
                        "long model-free drafts, but greedy output may differ from plain decoding at near-ties "
                        "(default: exact, token-identical; see README)")
    g.add_argument("--repack", action=argparse.BooleanOptionalAction, default=None,
                   help="let llama.cpp repack the weights for its CPU kernels, still token-identical: faster "
                        "decoding on some CPUs, slower prompt processing and loading (see README). Default: "
                        "whichever is faster for this model on this machine, measured once after its first run")
    g.add_argument("--suffix-memory", choices=SUFFIX_MEMORIES, default="saved",
                   help="what model-free drafting learns from: this request only, this process's earlier "
                        "requests, or those and earlier sessions' (saved: kept in the data dir's suffix-tree "
                        "folder; the default). `serve` always keeps to the request (no client sees another's)")
    g.add_argument("--placement", choices=DEVICE_CHOICES, default="auto",
                   help="where drafter and target run: auto (default) measures the options once (cached) and "
                        "picks the fastest: drafter on the GPU or on CPU threads (in turn or split, pre-drafting), "
                        "or the target on the GPU; gpu/cpu: the drafter there; target-gpu: the target there")


def add_technique_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine, KV cache and experts")
    g.add_argument("--engine", choices=ENGINES, default="auto",
                   help="where the target runs: auto (default) by file type (GGUF: llama.cpp; Hugging Face "
                        "folder: torch; ONNX: onnxruntime); torch: the torch engine, dequantized float32, which "
                        "has --kv-compress and --moe-offload")
    g.add_argument("--device", default=None, help="torch engine device: cpu or cuda (default: cuda when torch "
                   "sees a GPU)")
    g.add_argument("--kv-type", choices=LLAMA_KV_TYPES, default=None,
                   help="llama.cpp KV cache type (default: f16, or q8_0/q4_0 when the planner needs them to fit "
                        "the budget, said so); q8_0 is 1.9x smaller than f16, q4_0 3.6x; a quantized V cache "
                        "turns on flash attention, so greedy speculative output may differ from plain at near-ties")
    g.add_argument("--offload", choices=OFFLOAD_CHOICES, default=None, metavar="PLACEMENT",
                   help="a GGUF target bigger than --vram: run it as this placement instead of the fastest "
                        "predicted: a partial offload (n_gpu_layers) with the drafter on the GPU; b the target on "
                        "CPU threads, the GPU the drafter's; c-q8_0/c-q4_0 partial offload with that quantized KV "
                        "cache. Refused when it does not fit (`tandem plan --vram SIZE` lists each, priced)")
    g.add_argument("--kv-compress", choices=KV_COMPRESS_CHOICES, default="none",
                   help="torch engine: compressed KV cache: "
                        + "; ".join(f"{name}: {preset.summary}" for name, preset in PRESETS.items())
                        + " (quality costs: `tandem plan --engine torch`)")
    g.add_argument("--moe-offload", nargs="?", const="25%", default=None, metavar="BUDGET",
                   help="mixture-of-experts GGUF. llama.cpp (plain --moe-offload): keep the experts of as few "
                        "layers as --vram needs in host memory, everything else on the GPU. Torch engine: keep "
                        "experts in the file (CPU) or pinned RAM (CUDA) behind a cache of BUDGET device bytes, "
                        "e.g. 2GiB or 25%% of the experts (default 25%%); lossless at full precision")
    g.add_argument("--moe-eviction", choices=EVICTIONS, default="lru", help="expert cache eviction (default lru)")
    g.add_argument("--moe-prefetch", action="store_true", help="prefetch the next layer's guessed experts "
                   "(cross-layer gate; did not pay in the measured settings)")
    g.add_argument("--moe-low-bits", action="store_true",
                   help="load int4 copies for misses of low-weight experts (fewer bytes; not lossless)")


def moe_spec(args: argparse.Namespace) -> MoeOffloadSpec | None:
    if args.moe_offload is None:
        return None
    try:
        return MoeOffloadSpec(args.moe_offload, args.moe_eviction, args.moe_prefetch, args.moe_low_bits)
    except ValueError as exc:
        raise TandemError(str(exc)) from None


def spec_from_args(args: argparse.Namespace, *, model: str | Path | None = None) -> EngineSpec:
    """The :class:`EngineSpec` the flags of :func:`add_engine_flags` describe (``model``
    overrides ``-m``)."""
    for name in ("ctx", "threads", "draft_max"):
        value = vars(args)[name]
        if value is not None and value < 1:
            raise TandemError(f"--{name.replace('_', '-')} must be at least 1, got {value}.")
    if args.draft and args.draft_mode in ("ngram", "off"):
        print(f"tandem: --draft {args.draft} is not used with --draft-mode {args.draft_mode} "
              f"({'model-free drafting only' if args.draft_mode == 'ngram' else 'no drafting'}).", file=sys.stderr)
    threads = args.threads
    if threads is not None and threads > (cores := cpu_cores()):
        # llama.cpp's threads meet at a barrier every layer: one more than the cores waits
        # for a core to come free at every one (--threads 1000 on 2 cores: 1001 threads)
        print(f"tandem: --threads {threads} is more than the {cores} cores this process may run on: using {cores}.",
              file=sys.stderr)
        threads = cores
    return EngineSpec(
        target=resolve_model(str(model if model is not None else args.model)),
        drafter=resolve_model(args.draft) if args.draft else None,
        draft_mode=args.draft_mode,
        draft_max=args.draft_max,
        draft_len=args.draft_len,
        budget=args.budget,
        vram=args.vram,
        placement=args.placement,
        offload=args.offload,
        engine=args.engine,
        device=args.device,
        kv_type=args.kv_type,
        kv_compress=PRESETS[args.kv_compress].config if args.kv_compress != "none" else None,
        moe_offload=moe_spec(args),
        threads=threads,
        n_ctx=args.ctx,
        fast_verify=args.fast_verify,
        repack=args.repack,
        rpc=rpc_servers(args.rpc),
        suffix_memory=args.suffix_memory,
    )


def config_file() -> Path:
    """Tandem's config file: ``$TANDEM_HOME/config.toml``, else the user config dir's."""
    home = os.environ.get("TANDEM_HOME")
    return Path(home) / "config.toml" if home else Path(platformdirs.user_config_dir("tandem")) / "config.toml"


def rpc_servers(flag: str | None) -> tuple[str, ...]:
    """The servers ``--rpc`` names; without the flag, the config file's ``rpc`` entry
    (``rpc = ["host1:50052", "host2:50052"]`` or one comma-separated string); ``--rpc
    off`` ignores the config file."""
    if flag is not None:
        return () if flag.strip().lower() in ("off", "none", "") else parse_endpoints(flag)
    path = config_file()
    if not path.is_file():
        return ()
    import tomllib  # local: the parser (17 ms on a slow CPU) only for a config file that exists

    try:
        entry = tomllib.loads(path.read_text()).get("rpc")
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise TandemError(f"Cannot read {path}: {exc}") from None
    if entry is None:
        return ()
    if not isinstance(entry, str | list) or (isinstance(entry, list) and not all(isinstance(e, str) for e in entry)):
        raise TandemError(f'{path}: rpc must be "HOST:PORT,..." or a list of them.')
    return parse_endpoints(entry)
