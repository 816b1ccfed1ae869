"""How llama.cpp is asked to load a GGUF model and build its context: :class:`LlamaConfig`
(what Tandem chooses: context, batch, KV types, the exact configuration, repacked weights,
RPC peers, parallel sequences, host-held experts) and the parameter structs made from it.
The backend that loads with them is :mod:`tandem.runtime.backends.llama`; the planner
builds a :class:`LlamaConfig` without loading llama.cpp's model."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import llama_cpp

from tandem.errors import TandemError, UnsupportedModel
from tandem.models.shape import KV_TYPE_SIZES, DecoderShape

KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}
"""KV cache element types by name (ggml type ids), as llama.cpp's ``-ctk``/``-ctv``."""


@dataclass(frozen=True)
class LlamaConfig:
    n_ctx: int | None = None
    """Context length; ``None`` means the model's own, capped at 4096."""
    n_batch: int = 512
    n_threads: int | None = None
    n_gpu_layers: int = 0
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: bool = False
    exact: bool = True
    """Compute a verify batch exactly as one-token decode steps would, so greedy
    speculative output is token-identical to plain greedy output: flash attention off
    (a quantized V cache needs it, so ``exact`` holds only for f16/f32/bf16 V) and drafts
    verified in chunks no longer than
    :attr:`~tandem.runtime.backends.llama.LlamaCppBackend.exact_batch`. ``False``
    trades that identity for llama.cpp's fastest CPU kernels and one call per draft."""
    repack: bool = False
    """Let llama.cpp repack the weights into its extra CPU buffer types
    (``use_extra_bufts``; always on when not ``exact``). Their one-row kernels decode
    faster on some CPUs (Q4_K on AMD Zen 5 at 2 threads: 1.34x) and their batched ones
    prefill slower (0.74x there); they compute a batch of up to :data:`EXACT_BATCH_REPACKED`
    rows as steps do, so exactness holds with shorter verify chunks. The file is read
    rather than memory-mapped then, so resident memory stays the file's size (mapped, the
    pages of every repacked tensor stay resident beside its copy)."""
    rpc: tuple[str, ...] = ()
    """``HOST:PORT`` of llama.cpp RPC servers that hold a share of the blocks (see
    :mod:`tandem.runtime.backends.rpc`); the output head and the first blocks stay here."""
    rpc_layers: tuple[int, ...] = ()
    """Blocks for this machine, then for each RPC device, as the planner split them from
    the memory each server reports (:func:`tandem.runtime.planning.rpc_devices.plan_remote`);
    needed with :attr:`rpc`."""
    n_seq: int = 1
    """KV sequences in the one context, each of ``n_ctx`` tokens in its own KV stream
    (llama.cpp's ``n_seq_max`` with ``kv_unified`` off): the server's parallel slots,
    decoded together by :mod:`tandem.runtime.backends.llama_batch`. The backend's own
    ``evaluate`` uses sequence 0; with more than one, use the batcher's views instead."""
    gpu_devices: bool = True
    """``False``: llama.cpp sees no GPU at all (an empty device list), so nothing of the
    model, its KV cache or its big batches' matmuls goes to a GPU, on any build. For
    measuring host memory (the process baseline's tiny model), not for users."""
    host_expert_layers: int = 0
    """A mixture-of-experts GGUF: the experts of its first N expert layers stay in host
    memory while the rest goes where ``n_gpu_layers`` puts it (llama.cpp's ``--n-cpu-moe
    N``); ``-1``: every layer's experts (``-ot exps=CPU``). A dense model is refused
    (see :mod:`tandem.runtime.backends.host_experts`)."""


EXACT_BATCH = 7
"""Longest batch computed bit-for-bit like one-token steps in the exact configuration:
llama.cpp switches matmul kernels at 8 rows (see
:attr:`~tandem.runtime.backends.llama.LlamaCppBackend.exact_batch`)."""

EXACT_BATCH_REPACKED = 3
"""The same with repacked weights (:attr:`LlamaConfig.repack`): llama.cpp's repacked
matmul computes 4 rows at a time with another kernel, and any rows left over one by one
with the kernel a decode step uses."""


_NO_GPU_DEVICES = (ctypes.c_void_p * 1)()
"""A device list holding only its NULL terminator (llama.cpp reads ``NULL`` itself as
"every device"): no GPU. Module-level, so it outlives every load that points at it."""


def model_params(cfg: LlamaConfig) -> llama_cpp.llama_model_params:
    params = llama_cpp.llama_model_default_params()
    params.n_gpu_layers = cfg.n_gpu_layers
    if not cfg.gpu_devices:
        params.devices = ctypes.addressof(_NO_GPU_DEVICES)
        params.n_gpu_layers = 0
    params.use_extra_bufts = repacks(cfg)
    if params.use_extra_bufts:
        params.load_mode = llama_cpp.LLAMA_LOAD_MODE_NONE  # read, not mapped (see LlamaConfig.repack)
    return params


def repacks(cfg: LlamaConfig) -> bool:
    """Whether llama.cpp repacks the weights (see :attr:`LlamaConfig.repack`)."""
    return cfg.repack or not cfg.exact


def load_progress(report: Callable[[float], None]) -> llama_cpp.llama_progress_callback:
    """llama.cpp's load-progress callback (a fraction, 0 to 1, as tensors load) around
    ``report``. It runs inside llama.cpp, so it never raises: a failing ``report`` is
    ignored and loading goes on (returning false would abort the load)."""

    def callback(progress: float, _user_data: ctypes.c_void_p) -> bool:
        with contextlib.suppress(Exception):
            report(float(progress))
        return True

    return llama_cpp.llama_progress_callback(callback)


def context_params(cfg: LlamaConfig, n_ctx: int, threads: int) -> llama_cpp.llama_context_params:
    """``n_ctx`` per sequence; each of ``cfg.n_seq`` sequences gets its own KV stream, so a
    sequence's cells, and so its attention sums, are laid out as if it were alone."""
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = n_ctx * max(1, cfg.n_seq)
    params.n_seq_max = max(1, cfg.n_seq)
    params.kv_unified = False
    params.n_batch = min(cfg.n_batch, n_ctx)
    params.n_ubatch = min(cfg.n_batch, n_ctx)
    params.n_threads = threads
    params.n_threads_batch = threads
    params.type_k = KV_TYPES[cfg.type_k]
    params.type_v = KV_TYPES[cfg.type_v]
    flash = cfg.flash_attn or cfg.type_v not in ("f16", "f32", "bf16")
    params.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash
                              else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    params.no_perf = True
    return params




def check_kv_types(shape: DecoderShape, type_k: str, type_v: str) -> None:
    """A KV type llama.cpp has, whose blocks the model's heads hold whole."""
    for name in (type_k, type_v):
        if name not in KV_TYPES:
            raise TandemError(f"Unknown KV cache type {name!r}; choose one of {', '.join(KV_TYPES)}.")
        if not shape.kv_type_ok(name):
            raise UnsupportedModel(
                f"KV cache type {name} stores blocks of {KV_TYPE_SIZES[name][0]} values but this model's "
                f"attention heads have {shape.head_dim}; use f16 (or bf16) for this model."
            )
