"""A strict, bounds-checked reader of GGUF headers.

llama.cpp is trusted with valid files only: every model file passes through
:func:`inspect_gguf` first, which reads the header and tensor table with every length
checked against the file size, so a truncated, corrupted or foreign file becomes one
clear :class:`ModelFormatError` instead of a crash inside native code.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf

from tandem.models.errors import ModelFormatError, ModelNotFound, UnsupportedModel

MAGIC = b"GGUF"
SMALL_ARRAY = 64
"""Arrays longer than this are recorded by type and length only (vocabularies are big)."""

_SCALARS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}
_STRING, _ARRAY = 8, 9
KNOWN_ARCHITECTURES = frozenset(gguf.MODEL_ARCH_NAMES.values())


@dataclass(frozen=True)
class ArrayInfo:
    """A large metadata array, summarised."""

    item_type: int
    length: int


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int


@dataclass
class GGUFInfo:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    data_offset: int
    file_size: int
    notes: list[str] = field(default_factory=list)

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    def arch_value(self, key: str, default: Any = None) -> Any:
        """Read ``{architecture}.{key}`` such as ``context_length``."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    @property
    def n_params(self) -> int:
        return sum(_numel(t.shape) for t in self.tensors)

    @property
    def weights_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


class _Cursor:
    def __init__(self, data: memoryview, path: Path) -> None:
        self.data, self.pos, self.path = data, 0, path

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise ModelFormatError(
                f"{self.path} is truncated or corrupted: the GGUF header needs {n} bytes at "
                f"offset {self.pos} but the file ends at {len(self.data)}."
            )
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        raw = self.take(self.unpack("<Q"))
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            return bytes(raw).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type = self.unpack("<I")
            length = self.unpack("<Q")
            if item_type == _ARRAY and length:
                raise ModelFormatError(f"{self.path}: nested GGUF arrays are not supported.")
            if item_type in _SCALARS:
                size = struct.calcsize(_SCALARS[item_type])
                raw = self.take(size * length)  # bounds-checked before any allocation
                if length > SMALL_ARRAY:
                    return ArrayInfo(item_type, length)
                return list(struct.unpack(f"<{length}{_SCALARS[item_type][1]}", raw))
            if item_type != _STRING:
                raise ModelFormatError(f"{self.path}: unknown GGUF array item type {item_type}.")
            items = [self.string() for _ in range(length)]
            return ArrayInfo(item_type, length) if length > SMALL_ARRAY else items
        raise ModelFormatError(f"{self.path}: unknown GGUF value type {vtype} (corrupted file?).")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _tensor_nbytes(path: Path, name: str, shape: tuple[int, ...], ggml_type: int) -> int:
    try:
        qtype = gguf.GGMLQuantizationType(ggml_type)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise ModelFormatError(
            f"{path}: tensor {name!r} has unknown type {ggml_type} (corrupted, or made by a newer llama.cpp)."
        ) from None
    n = _numel(shape)
    if shape and shape[0] % block:
        raise ModelFormatError(f"{path}: tensor {name!r} row of {shape[0]} is not a multiple of its block {block}.")
    return n // block * type_size


def inspect_gguf(path: str | os.PathLike[str]) -> GGUFInfo:
    """Read and validate a GGUF file's header and tensor table (no tensor data is read)."""
    path = Path(path)
    if not path.exists():
        raise ModelNotFound(f"No such model file: {path}")
    if path.is_dir():
        raise ModelFormatError(f"{path} is a folder, not a GGUF file (convert it with `tandem convert`).")
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size < 24 or f.read(4) != MAGIC:
            raise ModelFormatError(f"{path} is not a GGUF model file (no GGUF magic bytes at its start).")
    import mmap

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)
        try:
            return _parse(path, view, size)
        finally:
            view.release()


def _parse(path: Path, view: memoryview, size: int) -> GGUFInfo:
    cur = _Cursor(view, path)
    cur.take(4)
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise ModelFormatError(f"{path}: GGUF version {version} is not supported (expected 2 or 3).")
    n_tensors = cur.unpack("<Q")
    n_kv = cur.unpack("<Q")
    # Every entry takes at least 8 bytes, so counts beyond size/8 are corruption.
    if n_tensors > size // 8 or n_kv > size // 8:
        raise ModelFormatError(f"{path} is corrupted: it claims {n_tensors} tensors and {n_kv} metadata keys.")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("<I"))
    tensors_raw = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("<I")
        if n_dims > 8:
            raise ModelFormatError(f"{path} is corrupted: tensor {name!r} claims {n_dims} dimensions.")
        shape = tuple(cur.unpack("<Q") for _ in range(n_dims))
        ggml_type = cur.unpack("<I")
        offset = cur.unpack("<Q")
        tensors_raw.append((name, shape, ggml_type, offset))
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ModelFormatError(f"{path} is corrupted: general.alignment is {alignment!r}.")
    data_offset = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, shape, ggml_type, offset in tensors_raw:
        nbytes = _tensor_nbytes(path, name, shape, ggml_type)
        end = data_offset + offset + nbytes
        if offset % alignment or end > size:
            raise ModelFormatError(
                f"{path} is truncated or corrupted: tensor {name!r} needs bytes up to {end} "
                f"but the file has {size}."
            )
        tensors.append(TensorInfo(name, shape, ggml_type, offset, nbytes))
    return GGUFInfo(path, version, metadata, tensors, data_offset, size)


def check_runnable(info: GGUFInfo) -> None:
    """Raise a clear error unless the file holds a model llama.cpp can run."""
    arch = info.architecture
    if arch is None:
        raise ModelFormatError(f"{info.path} has no general.architecture key: not a model file.")
    if arch not in KNOWN_ARCHITECTURES:
        raise UnsupportedModel(f"{info.path}: architecture {arch!r} is not supported by this runtime.")
    if not info.tensors:
        raise ModelFormatError(f"{info.path} holds a vocabulary only (no weights); it cannot generate text.")
