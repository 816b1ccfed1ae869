"""Open any model Tandem runs: a GGUF file (llama.cpp), an ONNX export (onnxruntime) or a
Hugging Face folder (the torch engine), behind the one Backend protocol, so `run`, `chat`,
`serve` and every drafter slot accept all three."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.models.extras import require
from tandem.runtime.backends import file_facts
from tandem.runtime.backends.protocol import Backend

if TYPE_CHECKING:  # the module loads llama.cpp's libraries: imported where a GGUF opens
    from tandem.runtime.backends.llama import LlamaCppBackend


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
        # local: loads llama.cpp only when this runs
        from tandem.runtime.backends.onnx import OnnxBackend, OnnxConfig

        return OnnxBackend(path, OnnxConfig(n_ctx=n_ctx, n_threads=n_threads))
    if kind == "torch":
        require("a Hugging Face folder (the torch engine)", "torch", "torch", "safetensors", "tokenizers")
        # local: loads llama.cpp and torch only when this runs
        from tandem.runtime.backends.torch_engine.backend import TorchBackend, TorchConfig

        return TorchBackend(path, TorchConfig(n_ctx=n_ctx, n_threads=n_threads))
    # local: loads llama.cpp only when this runs
    from tandem.runtime.backends.llama import LlamaCppBackend
    from tandem.runtime.backends.llama_config import LlamaConfig

    backend = LlamaCppBackend(path, llama_config or LlamaConfig(n_ctx=n_ctx, n_threads=n_threads), on_load=on_load)
    check_finite_once(backend)
    return backend


def check_finite_once(backend: LlamaCppBackend) -> None:
    """Have ``backend`` check its first logits for NaN or infinite values
    (:meth:`~tandem.runtime.backends.llama.LlamaCppBackend.check_first_logits`), once per
    file version and compute settings: the answer is the file's
    (:mod:`tandem.runtime.backends.file_facts`). A model on RPC servers is checked on
    every load (its weights are theirs)."""

    settings = backend.compute_settings()
    model_file = settings.model_file
    if model_file is None or settings.remote:
        backend.check_first_logits(lambda: None)
        return
    fact = f"finite logits|{settings.settings}"
    if file_facts.recall(model_file, fact) is not True:
        backend.check_first_logits(lambda: file_facts.remember(model_file, fact, True))
