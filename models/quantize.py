"""Quantize a GGUF with llama.cpp's own quantizer (``llama_model_quantize``).

Using llama.cpp's quantizer, not a re-implementation, means the files are exactly what
``llama-quantize`` makes, including its per-tensor type choices for the mixed K-quant
presets (Q4_K_M keeps some tensors at Q6_K) and its fallbacks for rows that are not a
multiple of the 256-wide K-quant block.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tandem.errors import ModelFormatError, ModelNotFound, TandemError, child_failure
from tandem.models.gguf_file import inspect_gguf
from tandem.models.paths import cache_dir
from tandem.models.python_child import code_argv

FILE_TYPES = {"f32": 0, "f16": 1, "q8_0": 7, "q4_0": 2, "q4_1": 3, "q4_k_m": 15}
"""GGUF output types by name -> ``llama_ftype`` (see llama_cpp.LLAMA_FTYPE_*)."""

QUANTIZED = ("q8_0", "q4_0", "q4_1", "q4_k_m")


def check_type(name: str) -> str:
    """Normalise a type name (``Q8_0`` -> ``q8_0``) or raise a clear error."""
    key = name.lower().replace("-", "_")
    if key not in FILE_TYPES:
        raise TandemError(f"Unknown output type {name!r}; choose one of {', '.join(FILE_TYPES)}.")
    return key


@contextlib.contextmanager
def _captured_native_stderr() -> Iterator[list[str]]:
    """Collect what native code writes to fd 2 (llama.cpp logs every tensor it quantizes)."""
    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            lines.extend(sink.read().decode("utf-8", "replace").splitlines())


def quantize_gguf(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], qtype: str, n_threads: int = 0
) -> Path:
    """Write ``dst``: ``src`` (an F32/F16 GGUF) quantized to ``qtype`` by llama.cpp."""
    import llama_cpp  # local: llama.cpp's libraries load only when this runs

    src, dst = Path(src), Path(dst)
    qtype = check_type(qtype)
    if not src.is_file():
        raise ModelNotFound(f"No such model file: {src}")
    inspect_gguf(src)  # native code only ever sees a structurally valid file
    if src.resolve() == dst.resolve():
        raise TandemError(f"Quantizing {src} onto itself would destroy it; choose another output path.")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FILE_TYPES[qtype]
    params.nthread = n_threads
    with _captured_native_stderr() as log:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0 or not dst.is_file():
        dst.unlink(missing_ok=True)
        tail = " | ".join(line for line in log[-3:] if line.strip())
        raise ModelFormatError(f"llama.cpp could not quantize {src} to {qtype} (returned {rc}): {tail}")
    return dst


def cached_copy_path(src: str | os.PathLike[str], qtype: str) -> Path:
    """Where :func:`cached_copy` keeps ``src`` quantized to ``qtype``: the user cache dir,
    named by the source's resolved path, size and modification time, so an edited or
    replaced source gets a fresh copy and nothing is ever re-quantized needlessly."""

    src = Path(src).resolve()
    st = src.stat()
    key = hashlib.sha256(f"{src}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "quantized" / f"{src.stem}-{key}-{check_type(qtype)}.gguf"


def cached_copy(src: str | os.PathLike[str], qtype: str) -> Path:
    """``src`` quantized to ``qtype`` by llama.cpp, made once and cached (see
    :func:`cached_copy_path`). The memory planner uses this for a drafter: a drafter's
    weights only shape its proposals and the target verifies every token, so a
    quantized drafter changes speed, never the output. Written to a temporary name and
    renamed, so a concurrent or interrupted run never sees half a file.

    The quantizer runs in a child process: it reads the whole model and allocates work
    buffers that the allocator keeps, which would otherwise stay in the resident memory
    of a process that was planned to a budget before the copy was made."""

    dst = cached_copy_path(src, qtype)
    if dst.is_file():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f"{dst.stem}.{os.getpid()}.tmp")
    code = "import sys; from tandem.models.quantize import quantize_gguf; quantize_gguf(*sys.argv[1:4])"
    try:
        proc = subprocess.run(code_argv(code, str(src), str(tmp), qtype),
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0 or not tmp.is_file():
            why = child_failure("quantizer child", proc.returncode, proc.stderr) if proc.returncode else "no output"
            raise ModelFormatError(f"Could not make a {qtype} copy of {src}: {why}")
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    return dst
