"""What an engine is asked for: :class:`EngineSpec`, the one description every front end
(`tandem run`, `chat`, `serve`, `bench`) fills from its flags, and the checks that refuse
settings that cannot apply before anything is loaded. :mod:`.builder` opens it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tandem.errors import TandemError
from tandem.models.extras import require
from tandem.runtime.backends.opener import backend_kind
from tandem.runtime.kv.config import KVCompressConfig
from tandem.runtime.moe.config import MoeOffloadSpec
from tandem.runtime.speculative.drafters.suffix import SuffixMemory
from tandem.runtime.speculative.factory import MODES, SpecOptions

ENGINES = ("auto", "llama.cpp", "torch")
"""``--engine``: where the target runs. ``auto``: by file type (GGUF: llama.cpp, a
Hugging Face folder: the torch engine, an ONNX export: onnxruntime)."""
LLAMA_KV_TYPES = ("f16", "q8_0", "q4_0")
"""``--kv-type`` for llama.cpp targets."""


@dataclass(frozen=True)
class EngineSpec:
    """Everything that decides how a target (+ drafter) is opened; sampling is per request."""

    target: Path
    drafter: Path | None = None
    draft_mode: str = "auto"
    """auto | model | xvocab | ngram | off (see :func:`build_strategy`)."""
    draft_max: int = 8
    draft_len: int | None = None
    """A fixed draft length instead of the adaptive policy."""
    budget: int | str | None = None
    """Host memory the process may use (``6GiB``); ``None``: the planner's share of RAM."""
    vram: int | str | None = None
    placement: str = "auto"
    """auto | gpu | cpu | target-gpu (:data:`tandem.runtime.planning.placement.DEVICE_CHOICES`)."""
    offload: str | None = None
    """A GGUF target bigger than ``vram``: the placement to run it in, one of those the
    planner compares (:data:`~tandem.runtime.planning.plan.OFFLOAD_CHOICES`: ``a`` partial
    offload, ``b`` the target on CPU threads, ``c-q8_0``/``c-q4_0`` a quantized KV cache),
    instead of the fastest predicted; refused when it does not fit
    (:mod:`tandem.runtime.planning.offload`). ``tandem bench --gpu --vram`` times each."""
    engine: str = "auto"
    """:data:`ENGINES`."""
    device: str | None = None
    """Torch engine only: ``cpu``, ``cuda``...; ``None``: CUDA when torch sees a GPU."""
    kv_type: str | None = None
    """llama.cpp KV cache type (:data:`LLAMA_KV_TYPES`); ``None``: f16, or the planner's
    choice of q8_0/q4_0 when f16 does not fit the budget (said in the notes)."""
    kv_compress: KVCompressConfig | None = None
    """Torch engine only: compressed KV cache (sinks + window, CAKE, KIVI/RotateKV)."""
    moe_offload: MoeOffloadSpec | None = None
    """Torch engine only: keep a mixture-of-experts model's experts behind a budgeted cache."""
    threads: int | None = None
    n_ctx: int | None = None
    """Context; ``None``: the model's, at most 4096 (shrunk by the planner to fit)."""
    fast_verify: bool = False
    """llama.cpp's fastest kernels instead of the exact configuration (greedy output may
    then differ from plain decoding at near-ties)."""
    repack: bool | None = None
    """llama.cpp's repacked weights, still exact (``LlamaConfig.repack``): faster decode
    steps on some CPUs, slower prompt processing and loading, verify calls of at most 3
    tokens. ``None``: whichever of the two is faster on this machine for this model,
    measured once (:mod:`tandem.runtime.backends.llama_kernels`)."""
    measure_cost: bool = True
    """Start the adaptive policy from a cached verify-cost curve for this model and machine."""
    suffix_memory: SuffixMemory = "saved"
    """What model-free drafting learns from besides the request (see
    :data:`~tandem.runtime.speculative.drafters.suffix.SuffixMemory`): the user's own
    earlier chats, kept across sessions; the server keeps to ``request`` (isolation)."""
    parallel: int = 1
    """KV sequences decoded together (``tandem serve --parallel``): the planner prices one
    context's KV per sequence; llama.cpp targets only (others serve one)."""
    rpc: tuple[str, ...] = ()
    """llama.cpp RPC servers (``HOST:PORT``) holding a share of a GGUF target's layers
    (:func:`~tandem.runtime.engine.builder._open_rpc`; README, "Several machines"); the drafter stays on this machine."""


def target_engine(spec: EngineSpec) -> str:
    """Where the target runs: ``llama.cpp``, ``torch`` or ``onnxruntime``."""
    if spec.engine not in ENGINES:
        raise TandemError(f"Unknown engine {spec.engine!r}; choose one of {', '.join(ENGINES)}.")
    kind = backend_kind(spec.target)
    if spec.engine == "torch":
        if kind == "onnx":
            raise TandemError("--engine torch runs GGUF files and Hugging Face folders, not ONNX exports.")
        return "torch"
    if spec.engine == "llama.cpp" and kind != "gguf":
        raise TandemError(f"--engine llama.cpp needs a GGUF file; {spec.target} is not one.")
    return {"gguf": "llama.cpp", "torch": "torch", "onnx": "onnxruntime"}[kind]


def check_spec(spec: EngineSpec, kind: str) -> None:
    """Refuse settings that cannot apply, before anything is loaded."""
    if spec.draft_mode not in MODES:
        raise TandemError(f"Unknown draft mode {spec.draft_mode!r}; choose one of {', '.join(MODES)}.")
    if spec.draft_mode in ("model", "xvocab") and spec.drafter is None:
        raise TandemError(f"--draft-mode {spec.draft_mode} needs a drafter model (--draft).")
    if spec.draft_max < 1 or (spec.draft_len is not None and spec.draft_len < 0):
        raise TandemError("The draft length must be positive.")
    if spec.kv_type is not None:
        if spec.kv_type not in LLAMA_KV_TYPES:
            raise TandemError(f"Unknown --kv-type {spec.kv_type!r}; choose one of {', '.join(LLAMA_KV_TYPES)}.")
        if kind != "llama.cpp":
            raise TandemError("--kv-type sets llama.cpp's KV cache; in the torch engine use --kv-compress.")
    if spec.kv_compress is not None and kind != "torch":
        raise TandemError("--kv-compress works in the torch engine: add --engine torch (the target runs there "
                          "dequantized, on CUDA when torch sees a GPU, else on the CPU).")
    if spec.moe_offload is not None and kind not in ("torch", "llama.cpp"):
        raise TandemError("--moe-offload applies to a mixture-of-experts GGUF (llama.cpp, or --engine torch).")
    if spec.moe_offload is not None and kind == "llama.cpp" and spec.moe_offload != MoeOffloadSpec():
        raise TandemError("--moe-offload BUDGET and its --moe-* options set the torch engine's expert cache: "
                          "add --engine torch. In llama.cpp, plain --moe-offload keeps as many layers' experts "
                          "in host memory as --vram needs.")
    if spec.offload is not None and (kind != "llama.cpp" or spec.rpc):
        raise TandemError("--offload picks how llama.cpp splits a GGUF target between the GPU and CPU threads; "
                          "it does not apply " + ("with --rpc." if spec.rpc else f"to the {kind} engine."))
    if spec.rpc and kind != "llama.cpp":
        raise TandemError("--rpc splits a GGUF target in llama.cpp over RPC servers; it does not apply to "
                          f"the {kind} engine.")
    if spec.device is not None and kind != "torch":
        raise TandemError("--device chooses the torch engine's device: add --engine torch.")
    if kind == "torch":
        flag = ("--kv-compress" if spec.kv_compress is not None else
                "--moe-offload" if spec.moe_offload is not None else
                "--engine torch" if spec.engine == "torch" else "a Hugging Face folder (the torch engine)")
        hf_folder = backend_kind(spec.target) == "torch"  # a GGUF in the torch engine needs torch alone
        require(flag, "torch", "torch", *(("safetensors", "tokenizers") if hf_folder else ()))
    elif kind == "onnxruntime":
        require("an ONNX model", "onnx", "onnxruntime", "tokenizers")


def spec_options(spec: EngineSpec, mode: str | None = None, draft_max: int | None = None) -> SpecOptions:
    """The strategy options ``spec`` asks for (``mode``/``draft_max``: as the plan settled
    them; placement adds its own settings to these)."""
    return SpecOptions(mode=mode or spec.draft_mode, draft_max=draft_max or spec.draft_max,
                       draft_length=spec.draft_len, measure_cost=spec.measure_cost,
                       suffix_memory=spec.suffix_memory)
