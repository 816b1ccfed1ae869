"""Open any model Tandem runs: a GGUF file (llama.cpp), an ONNX export (onnxruntime) or a
Hugging Face folder (the torch engine), behind the one Backend protocol, so `run`, `chat`,
`serve` and every drafter slot accept all three."""

from __future__ import annotations

from pathlib import Path

from tandem.runtime.backend import Backend


def backend_kind(path: str | Path) -> str:
    """``onnx``, ``torch`` (a Hugging Face folder) or ``gguf``, from what is on disk."""
    path = Path(path)
    if path.suffix == ".onnx" or (path.is_dir() and any(path.glob("*.onnx"))):
        return "onnx"
    if path.is_dir() and (path / "config.json").exists():
        return "torch"
    return "gguf"


def open_backend(path: str | Path, *, n_ctx: int | None = None, n_threads: int | None = None,
                 llama_config=None) -> Backend:
    """The backend for ``path``; ``llama_config`` (a planned ``LlamaConfig``) wins for GGUF."""
    kind = backend_kind(path)
    if kind == "onnx":
        from tandem.runtime.onnx_backend import OnnxBackend, OnnxConfig

        return OnnxBackend(path, OnnxConfig(n_ctx=n_ctx, n_threads=n_threads))
    if kind == "torch":
        from tandem.runtime.torch_engine.backend import TorchBackend, TorchConfig

        return TorchBackend(path, TorchConfig(n_ctx=n_ctx, n_threads=n_threads))
    from tandem.runtime.llama_backend import LlamaConfig, LlamaCppBackend

    return LlamaCppBackend(path, llama_config or LlamaConfig(n_ctx=n_ctx, n_threads=n_threads))
