"""The ggml libraries llama.cpp itself runs on, for the few ggml functions Tandem calls
through ctypes (the device registry, the CPU buffer type, the RPC backend).

llama-cpp-python's wheel ships each library three times (``libggml.so``, ``.so.0`` and
``.so.0.x.y``: copies, not links), and libllama is linked against the ``.so.0`` names.
``llama_cpp._ggml`` opens ``libggml.so``: a second copy of ggml with its own globals, so
its device registry is a second one, set up again over the same CUDA backend. On a CUDA
build, asking that copy for a device's memory before a model loads made the load die of
SIGSEGV (the GPU test tier on an H200). Opening the ``.so.0`` file returns the copy
already loaded (the loader matches it by file), so every call here reaches llama.cpp's own.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path


def loaded(name: str) -> ctypes.CDLL | None:
    """The copy of ``lib<name>`` that libllama is linked with, or ``None`` when the
    build has no such library (e.g. ``ggml-rpc`` without ``GGML_RPC=ON``)."""
    import llama_cpp  # local: llama.cpp's libraries load only when this runs

    lib = Path(llama_cpp.__file__).parent / "lib"
    for candidate in (f"lib{name}.so.0", f"lib{name}.0.dylib", f"lib{name}.so", f"lib{name}.dylib"):
        if (lib / candidate).exists():
            return ctypes.CDLL(str(lib / candidate))
    return None


@functools.cache
def libggml() -> ctypes.CDLL | None:
    """libllama's ``libggml`` (the backend registry), once its backends are registered."""
    import llama_cpp  # local: llama.cpp's libraries load only when this runs

    llama_cpp.llama_backend_init()  # registers the compiled-in backends (a no-op when done)
    return loaded("ggml")
