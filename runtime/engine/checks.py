"""What an :class:`~tandem.runtime.engine.spec.EngineSpec` settles into before anything is
loaded: the engine the target runs in, the refusal of settings that cannot apply there, and
the speculative strategy's options."""

from __future__ import annotations

from tandem.errors import TandemError
from tandem.models.extras import require
from tandem.runtime.backends.opener import backend_kind
from tandem.runtime.choices import ENGINES, LLAMA_KV_TYPES, MODES
from tandem.runtime.engine.spec import EngineSpec
from tandem.runtime.moe.config import MoeOffloadSpec
from tandem.runtime.speculative.factory import SpecOptions


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
