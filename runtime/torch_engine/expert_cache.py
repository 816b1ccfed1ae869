"""A byte-budgeted expert cache on the compute device, with HOBBIT eviction and Fate prefetch.

:class:`OffloadedExperts` replaces the engine's :class:`DenseExperts` behind
:meth:`MoEFeedForward.store.run`: experts stay in an :class:`ExpertSource` (mmap'd GGUF
or host RAM) and at most ``budget_bytes`` of them are resident on the compute device
(GPU when present; on a CPU-only machine the "device" is RAM over disk-resident
experts). Each feature is a switch in :class:`OffloadConfig`:

* **eviction** ``"hobbit"``: lowest priority goes first, priority = weighted recency +
  frequency + layer closeness (an expert of a layer that runs soon is worth more);
  ``"lru"``: recency only. Experts in use by the running layer are pinned, never evicted.
* **prefetch** (Fate's cross-layer gate): after layer ``l`` routes, layer ``l + 1``'s
  router is applied to layer ``l``'s FFN input; its top-k experts are loaded on a
  background thread while layer ``l`` computes. A wrong guess costs nothing but I/O:
  a needed expert that is neither cached nor in flight is loaded synchronously.
* **mixed precision** (HOBBIT): on a miss, an expert whose routing weight is below
  ``low_weight`` is loaded as its low-bit copy (fewer bytes, a quality cost measured in
  BENCHMARKS.md); high- and low-precision copies are separate cache entries.

With a budget that holds every expert at full precision the output equals the
un-offloaded model exactly (same kernels, same accumulation order).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import nn

from tandem.models.errors import UnsupportedModel
from tandem.runtime.torch_engine.expert_store import ExpertSource, ExpertWeights, LowBitExperts
from tandem.runtime.torch_engine.moe import swiglu

Key = tuple[int, int, bool]
"""(layer, expert, low_precision)."""


@dataclass(frozen=True)
class OffloadConfig:
    budget_bytes: int
    eviction: str = "hobbit"
    prefetch: bool = True
    mixed_precision: bool = False
    low_bits: int = 4
    low_weight: float = 0.3
    """Misses of experts with a routing weight below this load the low-bit copy."""
    w_recency: float = 1.0
    w_frequency: float = 1.0
    w_layer: float = 1.0

    def __post_init__(self) -> None:
        if self.eviction not in ("hobbit", "lru"):
            raise ValueError(f"eviction must be 'hobbit' or 'lru', got {self.eviction!r}")


@dataclass
class OffloadStats:
    calls: int = 0
    hits: int = 0
    misses: int = 0
    prefetch_hits: int = 0
    waited: int = 0
    low_precision: int = 0
    bytes_loaded: int = 0
    recall_by_layer: dict[int, list[int]] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hits / max(1, self.hits + self.misses)

    @property
    def prefetch_recall(self) -> float:
        """Fraction of the experts a layer actually used that the cross-layer gate predicted."""
        used = sum(v[1] for v in self.recall_by_layer.values())
        return sum(v[0] for v in self.recall_by_layer.values()) / max(1, used)


@dataclass
class _Entry:
    weights: ExpertWeights
    nbytes: int
    last: int
    count: int
    prefetched: bool


class ExpertCache:
    """Resident experts, their byte accounting and the eviction policy (thread-safe)."""

    def __init__(self, cfg: OffloadConfig, n_layers: int) -> None:
        self.cfg, self.n_layers = cfg, n_layers
        self.entries: dict[Key, _Entry] = {}
        self.used = 0
        self.clock = 0
        self.pinned: set[Key] = set()
        self.lock = threading.RLock()
        self.evictions = 0

    def priority(self, key: Key, entry: _Entry, current_layer: int) -> float:
        recency = 1.0 / (1 + self.clock - entry.last)
        if self.cfg.eviction == "lru":
            return recency
        freq = entry.count / max(1, self.clock)
        distance = (key[0] - current_layer) % self.n_layers  # layers until it runs again
        closeness = 1.0 - distance / self.n_layers
        return self.cfg.w_recency * recency + self.cfg.w_frequency * freq + self.cfg.w_layer * closeness

    def get(self, key: Key) -> _Entry | None:
        with self.lock:
            e = self.entries.get(key)
            if e is not None:
                e.last, e.count = self.clock, e.count + 1
            return e

    def insert(self, key: Key, weights: ExpertWeights, current_layer: int, prefetched: bool) -> bool:
        """Make room (never evicting pinned experts) and insert; False if it cannot fit."""
        size = weights.nbytes
        with self.lock:
            if key in self.entries:
                return True
            while self.used + size > self.cfg.budget_bytes:
                victims = [(self.priority(k, e, current_layer), k) for k, e in self.entries.items() if k not in self.pinned]
                if not victims:
                    return False
                _, k = min(victims)
                self.used -= self.entries.pop(k).nbytes
                self.evictions += 1
            self.entries[key] = _Entry(weights, size, self.clock, 0 if prefetched else 1, prefetched)
            self.used += size
            return True


class OffloadManager:
    """Shared by all MoE layers: source, cache, low-bit copies, prefetch thread and stats."""

    def __init__(
        self,
        source: ExpertSource,
        cfg: OffloadConfig,
        routers: list[torch.Tensor],
        n_used: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.source, self.cfg = source, cfg
        self.routers, self.n_used = routers, n_used
        self.device, self.dtype = device, dtype
        self.cache = ExpertCache(cfg, source.n_layers)
        self.low = LowBitExperts(source, cfg.low_bits) if cfg.mixed_precision else None
        self.stats = OffloadStats()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="expert-prefetch") if cfg.prefetch else None
        self._inflight: dict[Key, Future] = {}
        self._predicted: dict[int, set[int]] = {}

    def _fetch(self, key: Key) -> tuple[ExpertWeights, int]:
        layer, expert, low = key
        w, n = (self.low if low else self.source).load(layer, expert)
        w = w.to(self.device, self.dtype)
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        return w, n

    def _load_into_cache(self, key: Key, current_layer: int, prefetched: bool) -> ExpertWeights:
        w, n = self._fetch(key)
        self.stats.bytes_loaded += n
        self.cache.insert(key, w, current_layer, prefetched)
        return w

    def acquire(self, layer: int, expert: int, weight: float) -> ExpertWeights:
        """Weights for one expert of the running layer: cache, in-flight prefetch, or a sync load."""
        for low in (False, True):
            e = self.cache.get((layer, expert, low))
            if e is not None and (not low or weight < self.cfg.low_weight):
                self.stats.hits += 1
                if e.prefetched:
                    self.stats.prefetch_hits += 1
                    e.prefetched = False
                return e.weights
        low = self.low is not None and weight < self.cfg.low_weight
        key = (layer, expert, low)
        with self.cache.lock:
            self.cache.pinned.add(key)
        fut = self._inflight.get(key)
        if fut is not None:
            fut.result()
            e = self.cache.get(key)
            if e is not None:
                self.stats.hits += 1
                self.stats.waited += 1
                e.prefetched = False
                return e.weights
        self.stats.misses += 1
        self.stats.low_precision += int(low)
        return self._load_into_cache(key, layer, prefetched=False)

    def prefetch(self, layer: int, x: torch.Tensor) -> None:
        """Cross-layer gate: route ``x`` (layer ``layer``'s FFN input) with the next layer's router."""
        nxt = layer + 1
        if self._pool is None or nxt >= len(self.routers):
            return
        probs = torch.softmax(torch.nn.functional.linear(x, self.routers[nxt]).float(), dim=-1)
        guess = set(torch.topk(probs, self.n_used, dim=-1).indices.unique().tolist())
        self._predicted[nxt] = guess
        for e in guess:
            key = (nxt, e, False)
            if self.cache.get(key) is None and key not in self._inflight:
                self._inflight[key] = self._pool.submit(self._prefetch_one, key, layer)

    def _prefetch_one(self, key: Key, current_layer: int) -> None:
        try:
            self._load_into_cache(key, current_layer, prefetched=True)
        finally:
            self._inflight.pop(key, None)

    def record_recall(self, layer: int, used: set[int]) -> None:
        guess = self._predicted.pop(layer, None)
        if guess is None:
            return
        r = self.stats.recall_by_layer.setdefault(layer, [0, 0])
        r[0] += len(guess & used)
        r[1] += len(used)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class OffloadedExperts(nn.Module):
    """One layer's view of the :class:`OffloadManager`: the engine's ``ExpertStore``."""

    def __init__(self, manager: OffloadManager) -> None:
        super().__init__()
        self.manager = manager

    def run(self, layer: int, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        m = self.manager
        m.cache.clock += int(layer == 0)
        m.stats.calls += 1
        used = torch.unique(experts).tolist()
        with m.cache.lock:  # experts in use by this layer are never evicted (nor by prefetch)
            m.cache.pinned.update((layer, e, low) for e in used for low in (False, True))
        m.record_recall(layer, set(used))
        m.prefetch(layer, x)
        out = torch.zeros_like(x)
        try:
            for e in used:  # same order and kernels as DenseExperts: bit-identical when all hit
                rows, slot = torch.nonzero(experts == e, as_tuple=True)
                w = weights[rows, slot]
                ew = m.acquire(layer, e, float(w.max()))
                y = swiglu(x[rows], ew.gate, ew.up, ew.down)
                out.index_add_(0, rows, y * w[:, None].to(y.dtype))
        finally:
            with m.cache.lock:
                m.cache.pinned.clear()
        return out


def moe_layers(backend) -> list:
    """The engine's ``MoEFeedForward`` modules of a loaded :class:`TorchBackend`, in layer order."""
    from tandem.runtime.torch_engine.moe import MoEFeedForward

    ffns = [getattr(b, "ffn", None) for b in backend.model.blocks]
    if not ffns or not all(isinstance(f, MoEFeedForward) for f in ffns):
        raise UnsupportedModel(f"{backend.name} is not a mixture-of-experts model: nothing to offload.")
    return ffns


def enable_offload(backend, cfg: OffloadConfig, source: str = "gguf") -> OffloadManager:
    """Move a loaded MoE model's experts out of memory behind a budgeted cache.

    ``source="gguf"`` reads experts from the model file through mmap (the resident
    copies are dropped); ``"ram"`` keeps them in host RAM (pinned when CUDA is present).
    """
    from tandem.runtime.torch_engine.expert_store import GGUFExpertSource, RamExpertSource

    ffns = moe_layers(backend)
    if source == "gguf":
        src: ExpertSource = GGUFExpertSource(backend.path)
    elif source == "ram":
        src = RamExpertSource([(f.store.gate, f.store.up, f.store.down) for f in ffns])
    else:
        raise ValueError(f"source must be 'gguf' or 'ram', got {source!r}")
    routers = [f.router.detach() for f in ffns]
    manager = OffloadManager(src, cfg, routers, ffns[0].n_used, backend.device, backend.dtype)
    for f in ffns:
        f.store = OffloadedExperts(manager)
    return manager
