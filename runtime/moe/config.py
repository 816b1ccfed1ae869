"""Settings of MoE expert offloading, and what they cost: torch-free, so the planner and
the command line can name and price them without importing torch (the cache itself is
:mod:`tandem.runtime.moe.expert_cache`)."""

from __future__ import annotations

from dataclasses import dataclass


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


EVICTIONS = ("lru", "hobbit")


@dataclass(frozen=True)
class MoeOffloadSpec:
    """What ``--moe-offload`` asks for, before the model's expert bytes are known."""

    budget: str = "25%"
    """Device bytes for resident experts: a size (``2GiB``) or a share of all experts (``25%``)."""
    eviction: str = "lru"
    """``lru`` (the better setting measured, BENCHMARKS.md) or ``hobbit``."""
    prefetch: bool = False
    """Cross-layer-gate prefetch (Fate): did not pay in any measured setting, so off."""
    low_bits: bool = False
    """Load int4 copies for misses of low-weight experts (HOBBIT mixed precision): fewer
    bytes, not lossless."""

    def __post_init__(self) -> None:
        if self.eviction not in EVICTIONS:
            raise ValueError(f"eviction must be one of {EVICTIONS}, got {self.eviction!r}")

    def config(self, budget_bytes: int) -> OffloadConfig:
        return OffloadConfig(budget_bytes=budget_bytes, eviction=self.eviction, prefetch=self.prefetch,
                             mixed_precision=self.low_bits)

    def quality(self) -> str:
        """The measured quality cost (BENCHMARKS.md, "MoE expert offloading")."""
        if not self.low_bits:
            return "lossless: experts at full precision compute bit-identically to the in-memory model"
        return ("int4 substitutes for low-weight misses: KL 0.0025-0.42, next-token agreement 0.70-1.00 on the "
                "CPU models, KL 0.022 / agreement 0.979 on the H100 model (BENCHMARKS.md)")


SPEED_NOTE = ("offloading saves device memory, not time: on the CPU a 25 % LRU cache ran at 1.06-1.21x of "
              "load-on-demand and below in-memory; on an H100 with 201 MB experts at 4.1x load-on-demand, "
              "0.76x in-memory (BENCHMARKS.md)")
