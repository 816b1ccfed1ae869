"""KV caches for the torch engine: one object per sequence, all layers together.

The engine talks to a cache through four calls, so a compressed, quantized or evicting
cache (sinks + window, per-layer budgets, 2/4-bit keys) is a subclass that overrides
them and nothing in the model changes:

``update(layer, k, v, positions) -> (k_all, v_all, key_positions)``
    Called once per layer per forward pass with the *new* keys and values of shape
    ``(n_head_kv, T, head_dim)``. Keys arrive **already rotated** (RoPE applied at their
    absolute ``positions``, shape ``(T,)``). Returns everything the new queries attend
    over, shape ``(n_head_kv, S, head_dim)``, with the ``T`` new entries **last and in
    order**, plus the absolute position of each of the ``S`` keys. The engine lets every
    new query see all ``S - T`` older entries and applies its own causal (or tree) mask
    to the last ``T``; a cache that drops entries simply returns fewer older ones.
    ``k_all``/``v_all`` must be in the engine's dtype (dequantize before returning).

``commit(n_new)``
    Called once after all layers have been updated: the logical length grows by ``n_new``.

``trim(n)``
    Roll back to the first ``n`` logical tokens (speculative rejection, chat edits).
    Exact for every entry that is still held: entries at positions ``< n`` are untouched.

``keep(indices)``
    Tree verification (``TorchBackend.accept_path``): the last pass evaluated a token
    tree whose nodes are logical entries ``prefix .. len-1``, where ``prefix`` is the
    length before that pass (the cache remembers it at ``commit``). Keep the prefix,
    keep the nodes ``indices`` (increasing, all ``>= prefix``) renumbered
    ``prefix, prefix + 1, ...``, drop every other node. The accepted branch need not
    start at the first node (a tree may have several roots), so the prefix is *not*
    ``min(indices)``. An empty ``indices`` drops the whole tree.

``wants_attention`` / ``observe_attention(layer, probs)``
    A cache that needs attention statistics (e.g. CAKE budgets, H2O scores) sets
    ``wants_attention = True``; the engine then computes attention explicitly and passes
    the probabilities ``(n_head, T, S)`` after each layer.

``__len__`` is the logical number of tokens seen (the next position), which may exceed
what is physically stored once a cache evicts.
"""

from __future__ import annotations

import torch


class KVCache:
    """Base class and the full-precision cache: every key and value, growable storage."""

    wants_attention: bool = False

    def __init__(
        self,
        n_layer: int,
        n_head_kv: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        capacity: int = 256,
    ) -> None:
        self.n_layer = n_layer
        self.n_head_kv = n_head_kv
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self._capacity = max(1, capacity)
        self._k = [self._alloc(self._capacity) for _ in range(n_layer)]
        self._v = [self._alloc(self._capacity) for _ in range(n_layer)]
        self._pos = torch.zeros(self._capacity, dtype=torch.long, device=self.device)
        self._len = 0
        self._pass_start = 0

    def _alloc(self, capacity: int) -> torch.Tensor:
        return torch.zeros(self.n_head_kv, capacity, self.head_dim, dtype=self.dtype, device=self.device)

    def _grow(self, needed: int) -> None:
        """Double the storage until ``needed`` entries fit (amortised O(1) appends)."""
        if needed <= self._capacity:
            return
        cap = self._capacity
        while cap < needed:
            cap *= 2
        for store in (self._k, self._v):
            for i, old in enumerate(store):
                new = self._alloc(cap)
                new[:, : self._len] = old[:, : self._len]
                store[i] = new
        pos = torch.zeros(cap, dtype=torch.long, device=self.device)
        pos[: self._len] = self._pos[: self._len]
        self._pos = pos
        self._capacity = cap

    # -- the engine's interface -------------------------------------------------------
    def __len__(self) -> int:
        return self._len

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = k.shape[1]
        end = self._len + t
        self._grow(end)
        self._k[layer][:, self._len : end] = k
        self._v[layer][:, self._len : end] = v
        if layer == 0:
            self._pos[self._len : end] = positions
        return self._k[layer][:, :end], self._v[layer][:, :end], self._pos[:end]

    def commit(self, n_new: int) -> None:
        self._pass_start = self._len
        self._len += n_new

    def trim(self, n: int) -> None:
        self._len = max(0, min(n, self._len))
        self._pass_start = min(self._pass_start, self._len)

    def _tree_prefix(self, indices: list[int]) -> int:
        """The prefix :meth:`keep` preserves (start of the last pass), after checking ``indices``."""
        start = self._pass_start
        if any(b <= a for a, b in zip(indices, indices[1:], strict=False)):
            raise ValueError(f"keep indices must be increasing, got {indices}")
        if indices and (indices[0] < start or indices[-1] >= len(self)):
            raise ValueError(f"keep indices must lie in the last pass [{start}, {len(self)}), got {indices}")
        return start

    def keep(self, indices: list[int]) -> None:
        start = self._tree_prefix(indices)
        if indices:
            idx = torch.tensor(indices, dtype=torch.long, device=self.device)
            end = start + len(indices)
            for store in (self._k, self._v):
                for t in store:
                    t[:, start:end] = t[:, idx].clone()
            self._pos[start:end] = self._pos[idx].clone()
        self._len = self._pass_start = start + len(indices)

    def observe_attention(self, layer: int, probs: torch.Tensor) -> None:
        """Attention probabilities of the last pass; only called when ``wants_attention``."""

    def positions(self) -> torch.Tensor:
        """Absolute positions of the stored entries (in storage order)."""
        return self._pos[: self._len]

    def nbytes(self) -> int:
        """Bytes allocated for keys and values (what ``memory()`` reports)."""
        per = self.n_head_kv * self._capacity * self.head_dim * self._k[0].element_size()
        return 2 * self.n_layer * per

    def reset(self) -> None:
        self._len = self._pass_start = 0


class PastCache(KVCache):
    """A functional cache for graph export: starts from given past tensors, records presents.

    ONNX decoder-with-past graphs take the past keys/values as inputs and return the
    concatenation as outputs; this cache makes the same model code produce exactly that.
    """

    def __init__(self, past_k: list[torch.Tensor], past_v: list[torch.Tensor]) -> None:
        self.past_k = past_k
        self.past_v = past_v
        self.present_k: list[torch.Tensor] = list(past_k)
        self.present_v: list[torch.Tensor] = list(past_v)
        self._len = 0

    def __len__(self) -> int:
        return int(self.past_k[0].shape[1])

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        k_all = torch.cat([self.past_k[layer], k], dim=1)
        v_all = torch.cat([self.past_v[layer], v], dim=1)
        self.present_k[layer] = k_all
        self.present_v[layer] = v_all
        return k_all, v_all, torch.arange(k_all.shape[1], device=k.device)

    def commit(self, n_new: int) -> None:
        pass

    def nbytes(self) -> int:
        return 0
