"""The logits rows a ``llama_decode`` produced, as numpy arrays.

llama.cpp writes one row per flagged position of the batch into its context's output
buffer, in batch order (``llama_get_logits`` puts them back in that order when it split
the batch). Wrapping a ctypes pointer as an array (``np.ctypeslib.as_array``) builds a
ctypes array type each time: 30-40 µs, a fifth of the host's Python per step of a
151,936-token vocabulary. The buffer stays where it is from one decode to the next (it
moves only when llama.cpp grows it), so one view per row count is made once and reused
while the buffer's address is unchanged.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import llama_cpp
import numpy as np


class OutputRows:
    """Views of one llama.cpp context's output rows (read them before its next decode)."""

    def __init__(self, ctx, n_vocab: int) -> None:
        self._ctx = ctx
        self._n_vocab = n_vocab
        self._address: int | None = None
        self._views: dict[int, np.ndarray] = {}

    def block(self, n_out: int) -> np.ndarray:
        """The last decode's ``n_out`` rows, ``(n_out, n_vocab)``, a view into llama.cpp's buffer."""
        if n_out == 0:
            return np.empty((0, self._n_vocab), dtype=np.float32)
        ptr = llama_cpp.llama_get_logits(self._ctx)
        address = ctypes.cast(ptr, ctypes.c_void_p).value
        if address != self._address:  # the buffer moved (it grew): the old views point at freed memory
            self._address, self._views = address, {}
        view = self._views.get(n_out)
        if view is None:
            view = self._views[n_out] = np.ctypeslib.as_array(ptr, shape=(n_out, self._n_vocab))
        return view


def flagged(rows: Sequence[int]) -> list[int]:
    """The positions to flag for output in a batch for ``rows`` (asked in any order, maybe
    twice): each once, in batch order, as llama.cpp writes their rows."""
    return sorted(set(rows))


def in_asked_order(block: np.ndarray, positions: list[int], rows: Sequence[int], *, copy: bool) -> np.ndarray:
    """``block``'s rows (one per entry of ``positions``, :func:`flagged`) in the order
    ``rows`` asks for them: a copy, or with ``copy`` off the block itself where it is
    already in that order."""
    if positions == list(rows):
        return block.copy() if copy else block
    return block[[positions.index(i) for i in rows]]
