"""What every backend's single-sequence KV cache answers the same way, written once.

The llama.cpp, ONNX and torch backends each keep the ids their cache holds in
``_tokens`` and its length limit in ``_n_ctx``; :class:`TokenCache` turns those into the
protocol's ``tokens`` and ``n_ctx``. :class:`FixedTokenCache` adds the answers of a cache
that cannot move entries and has no bit-exact batch (ONNX, torch), which llama.cpp's
does differently.
"""

from __future__ import annotations

from collections.abc import Sequence


def new_tokens(tokens: Sequence[int]) -> list[int]:
    """``tokens`` as a list, for an ``evaluate``: at least one, since an empty batch has
    no logits to return."""
    tokens = list(tokens)
    if not tokens:
        raise ValueError("evaluate needs at least one token")
    return tokens


class TokenCache:
    """``tokens`` and ``n_ctx`` of :class:`~tandem.runtime.backends.protocol.Backend`."""

    _tokens: list[int]
    _n_ctx: int

    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    @property
    def tokens(self) -> list[int]:
        return list(self._tokens)


class FixedTokenCache(TokenCache):
    """A cache whose entries stay where they were computed (positions are baked into the
    keys) and whose batched calls agree with one-token steps to float rounding only."""

    def keep_spans(self, spans: Sequence[tuple[int, int]]) -> bool:
        """Cached entries are not moved here: the caller evaluates the prompt afresh."""
        return False

    @property
    def exact_batch(self) -> int | None:
        """No bit-exact bound on the batch length."""
        return None
