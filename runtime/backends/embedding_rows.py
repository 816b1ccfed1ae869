"""Rows of a GGUF model's token-embedding matrix, read from the file only when asked for.

Superposed decoding feeds ``Σ w_i E[tok_i]`` instead of a token id, so it needs the
input embeddings of at most k tokens per step. llama.cpp keeps ``E`` inside ggml buffers
it does not expose; reading and dequantizing the whole matrix from the file took 15 s
(10 s of it parsing the file's metadata with gguf-py) and 545 MB for Qwen2.5's
151,936 x 896 table: a cold start on the first request. Here the tensor's
bytes are memory-mapped at the offset the tensor table already gives
(:func:`tandem.models.gguf_file.inspect_gguf`), and a row is dequantized when it is
first mixed and kept in a bounded cache.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from tandem.errors import ModelFormatError
from tandem.models.gguf_file import GGUFInfo

TENSOR = "token_embd.weight"


class EmbeddingRows:
    """``rows(ids)`` -> float32 array (len(ids), n_embd), each row E[id]."""

    def __init__(self, info: GGUFInfo, n_embd: int, n_vocab: int, *, max_cached: int = 16384) -> None:
        tensor = next((t for t in info.tensors if t.name == TENSOR), None)
        if tensor is None:
            raise ModelFormatError(f"{info.path.name} has no {TENSOR} tensor to read embeddings from.")
        if tensor.shape[0] != n_embd or tensor.shape[-1] < n_vocab:
            raise ModelFormatError(f"{info.path.name}: {TENSOR} has shape {tensor.shape}, "
                                   f"not ({n_embd}, {n_vocab}).")
        self.info, self.tensor, self.n_embd = info, tensor, n_embd
        self.max_cached = max_cached
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._data: np.ndarray | None = None

    def _raw(self) -> np.ndarray:
        """The tensor's bytes, one row of the matrix per row (memory-mapped, nothing read yet)."""
        if self._data is None:
            import gguf  # local: gguf's reader only when a file is read here

            n_rows = self.tensor.shape[-1]
            self._data = np.memmap(self.info.path, dtype=np.uint8, mode="r",
                                   offset=self.info.data_offset + self.tensor.offset,
                                   shape=(n_rows, self.tensor.nbytes // n_rows))
            self._qtype = gguf.GGMLQuantizationType(self.tensor.ggml_type)
        return self._data

    def _read(self, ids: list[int]) -> np.ndarray:
        import gguf  # local: gguf's reader only when a file is read here

        raw = np.asarray(self._raw()[ids])
        q = self._qtype
        if q == gguf.GGMLQuantizationType.F32:
            return raw.view(np.float32).reshape(len(ids), self.n_embd).copy()
        if q == gguf.GGMLQuantizationType.F16:
            return raw.view(np.float16).reshape(len(ids), self.n_embd).astype(np.float32)
        return np.asarray(gguf.quants.dequantize(raw, q), dtype=np.float32).reshape(len(ids), self.n_embd)

    def rows(self, ids: Sequence[int]) -> np.ndarray:
        ids = [int(i) for i in ids]
        missing = sorted({i for i in ids if i not in self._cache})
        if missing:
            for i, row in zip(missing, self._read(missing), strict=True):
                self._cache[i] = row
        out = np.empty((len(ids), self.n_embd), dtype=np.float32)
        for r, i in enumerate(ids):
            out[r] = self._cache[i]
            self._cache.move_to_end(i)
        while len(self._cache) > self.max_cached:
            self._cache.popitem(last=False)
        return out

    @property
    def cached_bytes(self) -> int:
        return len(self._cache) * self.n_embd * 4
