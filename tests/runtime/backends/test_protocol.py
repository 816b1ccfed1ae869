"""The pure helpers every backend shares (``runtime/backends/protocol.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.runtime.backends.protocol import chunk_bounds, chunked_logits


@pytest.mark.parametrize("n, step, min_last, align, bounds", [
    (5, 16, 8, 4, [(0, 5)]),
    (16, 16, 8, 4, [(0, 16)]),
    (17, 16, 8, 4, [(0, 8), (8, 17)]),              # the tail of 1 takes 8 rows: two groups of 4
    (23, 16, 8, 4, [(0, 12), (12, 23)]),            # the tail of 7 takes one group
    (24, 16, 8, 4, [(0, 16), (16, 24)]),
    (38, 16, 8, 4, [(0, 16), (16, 28), (28, 38)]),
    (11, 8, 8, 4, [(0, 11)]),                        # the one before would fall under 8: joined
    (40, 16, 1, 1, [(0, 16), (16, 32), (32, 40)]),
    (1025, 512, 1, 1, [(0, 512), (512, 1024), (1024, 1025)]),
])
def test_chunk_bounds(n: int, step: int, min_last: int, align: int, bounds: list[tuple[int, int]]) -> None:
    assert chunk_bounds(n, step, min_last, align) == bounds


def test_chunked_logits_hands_each_chunk_its_own_rows() -> None:
    """Rows asked for come back in the caller's order, each from the chunk holding it."""
    calls = []

    def run(start: int, stop: int, rows: list[int]) -> list[np.ndarray]:
        calls.append((start, stop, rows))
        return [np.full(3, start + r, dtype=np.float32) for r in rows]

    out = chunked_logits(37, 16, 3, [36, 0, 17], run, min_last=8, align=4)
    assert calls == [(0, 16, [0]), (16, 28, [1]), (28, 37, [8])]
    assert out[:, 0].tolist() == [36, 0, 17]
