"""The optional parts of an install (pyproject's extras) and the one message a user gets
when a feature needs one that is missing.

The default install serves GGUF models on the CPU (llama.cpp, the chat app, the server,
the hub client). torch, onnxruntime and matplotlib are large, so they come as extras; the
code that needs them imports them inside functions or in modules the GGUF path never
imports, and asks :func:`require` first, so a missing extra is one line naming what to
install, never a traceback.
"""

from __future__ import annotations

import importlib.util

from tandem.errors import TandemError

EXTRA_OF = {
    "torch": "torch",
    "safetensors": "torch",
    "tokenizers": "torch",
    "onnxruntime": "onnx",
    "onnx": "onnx",
    "matplotlib": "plots",
}
"""Module -> the extra (``pip install "tandem[EXTRA]"``) that brings it, for an import that
failed where no :func:`require` asked first (tokenizers comes with [onnx] too)."""


class MissingExtra(TandemError):
    """A feature needs an optional dependency that this install lacks."""

    exit_code = 8


def installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (``import torch`` takes
    seconds; finding it takes microseconds)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing_message(feature: str, extra: str, *modules: str) -> str:
    """``FEATURE needs torch and onnx, which are not installed: pip install "tandem[torch,onnx]"``."""
    names = modules[0] if len(modules) == 1 else f"{', '.join(modules[:-1])} and {modules[-1]}"
    verb = "is" if len(modules) == 1 else "are"
    return f'{feature} needs {names}, which {verb} not installed: pip install "tandem[{extra}]"'


def require(feature: str, extra: str, *modules: str) -> None:
    """Raise :class:`MissingExtra` if any of ``modules`` is missing, naming ``extra`` (the
    extras that bring them all, e.g. ``torch,onnx``); called before the code that imports
    them, so nothing half runs."""
    missing = [m for m in modules if not installed(m)]
    if missing:
        raise MissingExtra(missing_message(feature, extra, *missing))
