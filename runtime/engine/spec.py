"""What an engine is asked for: :class:`EngineSpec`, the one description every front end
(`tandem run`, `chat`, `serve`, `bench`) fills from its flags, and whose settings take
the words of :mod:`tandem.runtime.choices`. :mod:`.checks` refuses what cannot apply and
:mod:`.builder` opens it.

This module imports nothing heavy: the command line builds its parser and the chat app
draws its first screen from it before the runtime (numpy, llama.cpp) is loaded."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.runtime.choices import SuffixMemory

if TYPE_CHECKING:
    from tandem.runtime.kv.config import KVCompressConfig
    from tandem.runtime.moe.config import MoeOffloadSpec


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
    """auto | gpu | cpu | target-gpu (:data:`~tandem.runtime.choices.DEVICE_CHOICES`)."""
    offload: str | None = None
    """A GGUF target bigger than ``vram``: the placement to run it in, one of those the
    planner compares (:data:`~tandem.runtime.choices.OFFLOAD_CHOICES`: ``a`` partial
    offload, ``b`` the target on CPU threads, ``c-q8_0``/``c-q4_0`` a quantized KV cache),
    instead of the fastest predicted; refused when it does not fit
    (:mod:`tandem.runtime.planning.offload`). ``tandem bench --gpu --vram`` times each."""
    engine: str = "auto"
    """:data:`~tandem.runtime.choices.ENGINES`."""
    device: str | None = None
    """Torch engine only: ``cpu``, ``cuda``...; ``None``: CUDA when torch sees a GPU."""
    kv_type: str | None = None
    """llama.cpp KV cache type (:data:`~tandem.runtime.choices.LLAMA_KV_TYPES`); ``None``:
    f16, or the planner's choice of q8_0/q4_0 when f16 does not fit the budget (said in
    the notes)."""
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
    :data:`~tandem.runtime.choices.SuffixMemory`): the user's own
    earlier chats, kept across sessions; the server keeps to ``request`` (isolation)."""
    parallel: int = 1
    """KV sequences decoded together (``tandem serve --parallel``): the planner prices one
    context's KV per sequence; llama.cpp targets only (others serve one)."""
    rpc: tuple[str, ...] = ()
    """llama.cpp RPC servers (``HOST:PORT``) holding a share of a GGUF target's layers
    (:func:`~tandem.runtime.engine.builder._open_rpc`; README, "Several machines"); the drafter stays on this machine."""
