"""A greedy run of any backend with the logits behind every token, for comparing backends,
caches and offloading settings token for token and logit for logit."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def greedy_rows(backend, prompt: Sequence[int], n: int) -> tuple[list[int], np.ndarray]:
    """``n`` greedy tokens after ``prompt`` from an empty cache, and the ``n + 1`` logits
    rows seen on the way (after the prompt, then after each token)."""
    backend.truncate(0)
    logits = backend.evaluate(list(prompt))[-1]
    out, rows = [], [logits]
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = backend.evaluate(out[-1:])[-1]
        rows.append(logits)
    return out, np.stack(rows)
