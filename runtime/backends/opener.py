"""Open any model Tandem runs: a GGUF file (llama.cpp), an ONNX export (onnxruntime) or a
Hugging Face folder (the torch engine), behind the one Backend protocol, so `run`, `chat`,
`serve` and every drafter slot accept all three."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tandem.errors import ModelFormatError
from tandem.models.extras import require
from tandem.runtime.backends.protocol import Backend


def backend_kind(path: str | Path) -> str:
    """``onnx``, ``torch`` (a Hugging Face folder) or ``gguf``, from what is on disk."""
    path = Path(path)
    if path.suffix == ".onnx" or (path.is_dir() and any(path.glob("*.onnx"))):
        return "onnx"
    if path.is_dir() and (path / "config.json").exists():
        return "torch"
    return "gguf"


def open_backend(path: str | Path, *, n_ctx: int | None = None, n_threads: int | None = None,
                 llama_config=None, on_load: Callable[[float], None] | None = None) -> Backend:
    """The backend for ``path``; ``llama_config`` (a planned ``LlamaConfig``) wins for GGUF.
    ``on_load`` hears the fraction loaded where the runtime reports it (llama.cpp)."""
    kind = backend_kind(path)
    if kind == "onnx":
        require("an ONNX model", "onnx", "onnxruntime", "tokenizers")
        from tandem.runtime.backends.onnx import OnnxBackend, OnnxConfig

        return OnnxBackend(path, OnnxConfig(n_ctx=n_ctx, n_threads=n_threads))
    if kind == "torch":
        require("a Hugging Face folder (the torch engine)", "torch", "torch", "safetensors", "tokenizers")
        from tandem.runtime.backends.torch_engine.backend import TorchBackend, TorchConfig

        return TorchBackend(path, TorchConfig(n_ctx=n_ctx, n_threads=n_threads))
    from tandem.runtime.backends.llama import LlamaConfig, LlamaCppBackend

    backend = LlamaCppBackend(path, llama_config or LlamaConfig(n_ctx=n_ctx, n_threads=n_threads), on_load=on_load)
    try:
        check_finite_once(backend)
    except BaseException:
        backend.close()
        raise
    return backend


PROBE_TEXT = " The quick brown fox jumps over the lazy dog."
PROBE_TOKENS = 4
"""Tokens of :data:`PROBE_TEXT` the check evaluates. A NaN or infinite weight in any
matrix reaches every row's logits, so a few rows find it; each one more costs a new
pair's first run (0.02 s a token for a 1.5B model on 2 cores)."""


def check_finite_once(backend: Backend) -> None:
    """:func:`check_finite_logits`, once per file version and compute settings (the
    answer is the file's: :mod:`tandem.runtime.backends.file_facts`)."""
    from tandem.runtime.backends import file_facts

    settings = backend.compute_settings()
    if settings.model_file is None or settings.remote:
        check_finite_logits(backend)
        return
    fact = f"finite logits|{settings.settings}"
    if file_facts.recall(settings.model_file, fact) is True:
        return
    check_finite_logits(backend)
    file_facts.remember(settings.model_file, fact, True)


def check_finite_logits(backend: Backend) -> None:
    """One short forward pass after loading: damaged weights (a NaN or infinite scale in
    a quantized block) give NaN or infinite logits, which would otherwise be "generated"
    as garbage. Reports them as a corrupted file instead; the cache is left empty."""
    import numpy as np  # local: numpy's import (0.06 s) only when this runs

    bos = backend.special.bos
    ids = ([] if bos is None else [bos]) + backend.tokenize(PROBE_TEXT)[: max(1, min(PROBE_TOKENS, backend.n_ctx - 2))]
    try:
        logits = backend.evaluate(ids or [0], logits_for=range(len(ids or [0])))
    finally:
        backend.truncate(0)
    if not np.isfinite(logits).all():
        raise ModelFormatError(f"{backend.name}: the model computes NaN or infinite values on a test prompt; "
                               "its weights are damaged (re-download or re-convert the file).")
