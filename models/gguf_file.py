"""A strict, bounds-checked reader of GGUF headers.

llama.cpp is trusted with valid files only: every model file passes through
:func:`inspect_gguf` first, which reads the header and tensor table with every length
checked against the file size, so a truncated, corrupted or foreign file becomes one
clear :class:`ModelFormatError` instead of a crash inside native code.
"""

from __future__ import annotations

import functools
import hashlib
import math
import mmap
import os
import stat
import struct
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tandem.errors import ModelFormatError, ModelNotFound, UnsupportedModel
from tandem.models.shape import DecoderShape, dims_from_gguf

MAGIC = b"GGUF"
SMALL_ARRAY = 64
"""Arrays longer than this are recorded by type and length only (vocabularies are big)."""

_SCALARS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")


@functools.cache
def known_architectures() -> frozenset[str]:
    """The architectures llama.cpp's ``gguf`` package names."""
    import gguf  # local: the package loads numpy, which a command that only lists or resolves models never needs

    return frozenset(gguf.MODEL_ARCH_NAMES.values())


@functools.cache
def block_sizes() -> dict[int, tuple[int, int]]:
    """Elements per block and bytes per block of each tensor type llama.cpp's ``gguf``
    package knows, by the type's number in a GGUF tensor table."""
    import gguf  # local: see known_architectures

    return {int(qtype): sizes for qtype, sizes in gguf.GGML_QUANT_SIZES.items()}


@dataclass(frozen=True)
class ArrayInfo:
    """A large metadata array, summarised."""

    item_type: int
    length: int
    digest: str = ""
    """A hash of a string array's bytes as stored (a vocabulary's tokens): two files whose
    digests match store the same strings in the same order."""


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

    def vocabulary(self) -> str | None:
        """The stored vocabulary's identity (tokenizer kind, pre-tokenizer, a digest of
        every token's text): equal for two files whose token ids mean the same text;
        ``None`` where the tokens are not a summarised array."""
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, ArrayInfo) or not tokens.digest:
            return None
        return "/".join((str(self.metadata.get("tokenizer.ggml.model")), str(self.metadata.get("tokenizer.ggml.pre")),
                         str(tokens.length), tokens.digest))

    def shape(self) -> DecoderShape:
        """The model's dimensions from its metadata; the vocabulary is the tokenizer's
        size and the head is tied when there is no ``output.weight``."""
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        n_vocab = tokens.length if isinstance(tokens, ArrayInfo) else len(tokens) if isinstance(tokens, list) else 0
        return dims_from_gguf(self.arch_value, n_vocab, tied=all(t.name != "output.weight" for t in self.tensors))


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

    def skip_strings(self, count: int) -> None:
        """Step over ``count`` strings, each length still checked against the file: a
        vocabulary's 150 000 tokens are summarised, never decoded (the planner and the
        backends read the vocabulary through llama.cpp)."""
        data, pos, end = self.data, self.pos, len(self.data)
        unpack_from = _U64.unpack_from
        for _ in range(count):
            if pos + 8 > end:
                break
            after = pos + 8 + unpack_from(data, pos)[0]
            if after > end:
                break
            pos = after
        else:
            self.pos = pos
            return
        self.pos = pos
        self.string()  # raises the truncation error at this string's offset

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
            if length > SMALL_ARRAY:
                start = self.pos
                self.skip_strings(length)  # ~3 ms to hash a 151k-token vocabulary's 2 MB
                return ArrayInfo(item_type, length, hashlib.blake2b(self.data[start:self.pos], digest_size=16).hexdigest())
            return [self.string() for _ in range(length)]
        raise ModelFormatError(f"{self.path}: unknown GGUF value type {vtype} (corrupted file?).")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _tensor_nbytes(path: Path, name: str, shape: tuple[int, ...], ggml_type: int) -> int:
    sizes = block_sizes().get(ggml_type)
    if sizes is None:
        raise ModelFormatError(
            f"{path}: tensor {name!r} has unknown type {ggml_type} (corrupted, or made by a newer llama.cpp)."
        )
    block, type_size = sizes
    n = _numel(shape)
    if shape and shape[0] % block:
        raise ModelFormatError(f"{path}: tensor {name!r} row of {shape[0]} is not a multiple of its block {block}.")
    return n // block * type_size


RACY_NS = 2_000_000_000
"""A file modified this recently is read afresh every time: the file system's clock is
coarse, so a rewrite within its tick could keep the same size and mtime (git's "racy"
entries)."""
_READ: dict[tuple[Path, int, int, int], GGUFInfo] = {}
"""Headers read in this process, by file version: the planner and the backend of one
load both read the file, and a server reopens a slot's model."""


def inspect_gguf(path: str | os.PathLike[str]) -> GGUFInfo:
    """Read and validate a GGUF file's header and tensor table (no tensor data is read).

    A file read before in this process, unchanged since (same inode, size and mtime), is
    not read again (unless it changed in the last :data:`RACY_NS`); each caller gets its own copy of the metadata and tensor lists."""
    path = Path(path)
    size = check_regular_file(path)
    try:
        st = path.stat()
        version = (path.resolve(), st.st_ino, st.st_size, st.st_mtime_ns)
    except OSError:
        return _read(path, size)
    if time.time_ns() - st.st_mtime_ns < RACY_NS:
        return _read(path, size)
    if version not in _READ:
        if len(_READ) >= 8:
            _READ.clear()
        _READ[version] = _read(path, size)
    return _copy(_READ[version], path)


def _copy(info: GGUFInfo, path: Path) -> GGUFInfo:
    return replace(info, path=path, metadata=dict(info.metadata), tensors=list(info.tensors), notes=list(info.notes))


def _read(path: Path, size: int) -> GGUFInfo:

    try:
        with open(path, "rb") as f:
            if f.read(4) != MAGIC:
                raise ModelFormatError(f"{path} is not a GGUF model file (no GGUF magic bytes at its start).")
            if size < 24:  # the magic, then less than a header
                raise ModelFormatError(f"{path} is truncated: {size} bytes, less than a GGUF header (24).")
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                return _parse(path, view, size)
            finally:
                view.release()
    except OSError as exc:
        raise ModelFormatError(f"Cannot read {path}: {exc.strerror or exc}.") from None


def check_regular_file(path: Path) -> int:
    """The size of ``path`` if it is a readable regular file; a clear error otherwise.

    Checked with ``stat`` before anything opens it: opening a FIFO blocks until a writer
    appears, and a device can be endless.
    """
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ModelNotFound(f"No such model file: {path}") from None
    except OSError as exc:
        raise ModelFormatError(f"Cannot read {path}: {exc.strerror or exc}.") from None
    if stat.S_ISDIR(st.st_mode):
        raise ModelFormatError(f"{path} is a folder, not a GGUF file (convert it with `tandem convert`).")
    if not stat.S_ISREG(st.st_mode):
        raise ModelFormatError(f"{path} is not a regular file (a pipe, socket or device); a model must be a file.")
    if not os.access(path, os.R_OK):
        raise ModelFormatError(f"Cannot read {path}: permission denied.")
    return st.st_size


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
    if arch not in known_architectures():
        raise UnsupportedModel(f"{info.path}: architecture {arch!r} is not supported by this runtime.")
    if not info.tensors:
        raise ModelFormatError(f"{info.path} holds a vocabulary only (no weights); it cannot generate text.")
    check_hyperparameters(info)


MAX_LAYERS = 1024
MAX_CONTEXT = 1 << 24
_EPS_KEYS = ("attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon")


def _layer_indices(info: GGUFInfo) -> set[int]:
    out = set()
    for t in info.tensors:
        parts = t.name.split(".")
        if len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit():
            out.add(int(parts[1]))
    return out


def _int_key(info: GGUFInfo, key: str, lo: int, hi: int) -> int | None:
    value = info.arch_value(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ModelFormatError(f"{info.path} is corrupted: {info.architecture}.{key} is {value!r} "
                               f"(expected an integer in {lo}..{hi}).")
    return value


def check_hyperparameters(info: GGUFInfo) -> None:
    """The metadata llama.cpp trusts without checking (it aborts the process, or
    computes garbage, on a layer count, epsilon or head count that makes no sense),
    checked against sane ranges and against the tensor table."""
    path, arch = info.path, info.architecture
    layers = _layer_indices(info)
    n_layer = _int_key(info, "block_count", 1, MAX_LAYERS)
    if n_layer is not None and layers and (max(layers) + 1 != n_layer or len(layers) != n_layer):
        raise ModelFormatError(f"{path} is corrupted: {arch}.block_count says {n_layer} layers but the file "
                               f"holds tensors for {len(layers)}.")
    _int_key(info, "context_length", 1, MAX_CONTEXT)
    n_embd = _int_key(info, "embedding_length", 1, 1 << 20)
    n_head = _int_key(info, "attention.head_count", 1, 1 << 14)
    n_head_kv = _int_key(info, "attention.head_count_kv", 1, 1 << 14)
    if n_head is not None and n_head_kv is not None and n_head % n_head_kv:
        raise ModelFormatError(f"{path} is corrupted: {n_head} attention heads cannot be shared by "
                               f"{n_head_kv} KV heads.")
    key_length = _int_key(info, "attention.key_length", 1, 1 << 16)
    if n_embd is not None and n_head is not None and key_length is None and n_embd % n_head:
        raise ModelFormatError(f"{path} is corrupted: an embedding of {n_embd} does not split into "
                               f"{n_head} heads.")
    for key in _EPS_KEYS:
        eps = info.arch_value(key)
        if eps is not None and (not isinstance(eps, int | float) or isinstance(eps, bool)
                                or not math.isfinite(eps) or not 0 < eps < 1):
            raise ModelFormatError(f"{path} is corrupted: {arch}.{key} is {eps!r} (expected a small positive number).")
    _check_embeddings(info, n_embd)


def _check_embeddings(info: GGUFInfo, n_embd: int | None) -> None:
    """The token-embedding matrix must match the vocabulary and the embedding width."""
    embd = next((t for t in info.tensors if t.name == "token_embd.weight"), None)
    if embd is None or len(embd.shape) != 2:
        return
    width, rows = embd.shape
    if n_embd is not None and width != n_embd:
        raise ModelFormatError(f"{info.path} is corrupted: token_embd.weight is {width} wide but "
                               f"{info.architecture}.embedding_length is {n_embd}.")
    tokens = info.metadata.get("tokenizer.ggml.tokens")
    n_vocab = tokens.length if isinstance(tokens, ArrayInfo) else len(tokens) if isinstance(tokens, list) else None
    if n_vocab is not None and n_vocab != rows:
        raise ModelFormatError(f"{info.path} is corrupted: the vocabulary has {n_vocab} tokens but "
                               f"token_embd.weight has {rows} rows.")
    declared = info.arch_value("vocab_size")
    if declared is not None and declared != rows:
        raise ModelFormatError(f"{info.path} is corrupted: {info.architecture}.vocab_size is {declared!r} but "
                               f"token_embd.weight has {rows} rows.")
    if any(d == 0 for t in info.tensors for d in t.shape):
        raise ModelFormatError(f"{info.path} is corrupted: a tensor has a zero-sized dimension.")
