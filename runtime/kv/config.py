"""Settings of the torch engine's compressed KV cache, what they hold, and what they cost.

Torch-free, so the memory planner and the command line can name and price a setting
without importing torch; the cache itself is :mod:`tandem.runtime.kv.compress`.

:data:`PRESETS` are the settings ``--kv-compress`` offers, each with the quality cost
measured for it (BENCHMARKS.md, "KV cache compression": teacher-forced against the full
cache on stories260K and tinystories-656k); :func:`held_bytes` is the memory the planner
prices for a setting at a context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

POLICIES = ("none", "window", "cake")
HOLD_NAMES = (None, "float16", "float32")


@dataclass(frozen=True)
class KVCompressConfig:
    policy: str = "window"
    sinks: int = 4
    window: int = 64
    """``window`` policy: recent tokens kept. ``cake``: the observation window (always kept)."""
    budget: int = 128
    """``cake`` policy: average tokens kept per layer (total = budget x layers)."""
    cascade: bool = True
    """``cake``: cascading budgets inside long passes (prefill), see the module docstring."""
    bits: int | None = None
    """8, 4 or 2-bit quantization of non-sink values (and keys unless ``key_bits``); None: full precision."""
    key_bits: int | None = None
    """Bits for keys when they should differ from ``bits`` (keys set attention logits,
    which softmax amplifies, so they are the more sensitive half)."""
    group: int = 32
    """Channels per quantization group of a token's row (values; keys in ``token`` mode)."""
    key_mode: str = "token"
    """``token``: RotateKV per-token groups after reordering + Hadamard; ``channel``: KIVI."""
    key_group: int = 64
    """``channel`` mode: tokens sharing one step/minimum per channel."""
    residual: int = 0
    """``channel`` mode: newest tokens always kept full precision beyond the partial group."""
    pre_rope: bool = True
    """Quantize keys before RoPE (RotateKV, KVQuant: channel structure is cleaner there);
    False stores them as the engine gives them (KIVI), which spares re-applying RoPE to
    every stored key on every read."""
    rotate: bool = True
    """Hadamard rotation before per-token quantization (off: plain quantization, ablation)."""
    rot_block: int | None = None
    """Hadamard block size (None: the largest power of two dividing the row width)."""
    hold: str | None = None
    """dtype of full-precision entries: None (the engine's) or ``float16``."""
    cake_gamma: float = 200.0
    stat_window: int = 8
    """``cake``: horizon in queries of the running attention moments (exact mean over the
    first ``stat_window`` queries, then an exponential average). With 32 (the observation
    window) the average forgets old attention too slowly: on stories260K at budget 64 the
    KL to the full cache was 0.0186 against 0.0081 with 8 (the exact 32-row window that
    needed 4x the cache's memory: 0.0086)."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        for b in (self.bits, self.key_bits):
            if b not in (None, 2, 4, 8):
                raise ValueError(f"bits must be 2, 4, 8 or None, got {b}")
        if self.key_bits is not None and self.bits is None:
            raise ValueError("key_bits needs bits (the value bits) as well")
        if self.key_mode not in ("token", "channel") or self.hold not in HOLD_NAMES:
            raise ValueError(f"bad key_mode {self.key_mode!r} or hold {self.hold!r}")
        if min(self.window, self.budget, self.key_group, self.stat_window) < 1 or min(self.sinks, self.residual) < 0:
            raise ValueError("sinks >= 0, residual >= 0, window, budget, key_group and stat_window >= 1 are required")


@dataclass(frozen=True)
class Measured:
    """Quality of a setting against the full cache (BENCHMARKS.md), on the two toy models."""

    row: str
    """The BENCHMARKS.md table row."""
    kl: tuple[float, float]
    """Mean KL(full || setting) per token: stories260K, tinystories-656k."""
    agree: tuple[float, float]
    """Top-1 agreement with the full cache: stories260K, tinystories-656k."""
    ppl: tuple[float, float]
    """Held-out perplexity change, %: stories260K, tinystories-656k."""

    def describe(self) -> str:
        return (f"KL {self.kl[0]:.4f}-{self.kl[1]:.4f}, next-token agreement {min(self.agree):.3f}-"
                f"{max(self.agree):.3f}, perplexity {self.ppl[0]:+.2f} %/{self.ppl[1]:+.2f} % vs the full cache "
                f"(BENCHMARKS.md '{self.row}', toy models)")


@dataclass(frozen=True)
class Preset:
    config: KVCompressConfig
    measured: Measured
    summary: str


_KIVI = {"key_mode": "channel", "key_group": 64, "group": 32, "hold": "float16"}
PRESETS: dict[str, Preset] = {
    "window": Preset(KVCompressConfig(policy="window", sinks=4, window=60),
                     Measured("sinks4+window60", (0.0337, 0.1497), (0.948, 0.843), (5.14, -4.25)),
                     "StreamingLLM: 4 sink tokens + the 60 most recent (cache-relative positions)"),
    "cake": Preset(KVCompressConfig(policy="cake", sinks=4, window=32, budget=64),
                   Measured("cake budget64 obs32", (0.0081, 0.0721), (0.964, 0.860), (1.77, -1.47)),
                   "CAKE: 64 tokens per layer on average, split by attention entropy and variance"),
    "kivi4": Preset(KVCompressConfig(policy="none", bits=4, **_KIVI),
                    Measured("kivi K4 V4", (0.0019, 0.0060), (0.982, 0.960), (0.31, 2.40)),
                    "KIVI 4-bit: keys per channel over 64-token groups, values per token (Hadamard)"),
    "kivi8": Preset(KVCompressConfig(policy="none", bits=4, key_bits=8, **_KIVI),
                    Measured("kivi K8 V4", (0.0011, 0.0054), (0.982, 0.970), (0.13, 1.39)),
                    "KIVI 8-bit keys, 4-bit values"),
    "rotatekv": Preset(KVCompressConfig(policy="none", bits=4, key_bits=8, group=32),
                       Measured("rotatekv K8 V4 g32", (0.0015, 0.0055), (0.979, 0.963), (0.28, 1.46)),
                       "RotateKV: Hadamard-rotated per-token groups, 8-bit keys, 4-bit values"),
    "cake+kivi4": Preset(KVCompressConfig(policy="cake", sinks=4, window=32, budget=128, bits=4, **_KIVI),
                         Measured("cake budget128 + kivi K4 V4", (0.0040, 0.0332), (0.987, 0.917), (-0.52, -0.71)),
                         "CAKE 128 tokens per layer + KIVI 4-bit (the best trade-off measured)"),
    "cake+k8v4": Preset(KVCompressConfig(policy="cake", sinks=4, window=32, budget=64, bits=4, key_bits=8, group=32),
                        Measured("cake budget64 + K8 V4", (0.0100, 0.0866), (0.961, 0.837), (1.43, 0.32)),
                        "CAKE 64 tokens per layer + RotateKV 8-bit keys, 4-bit values"),
}
"""``--kv-compress`` settings, each as benchmarked."""


def quantized_row_bytes(width: int, bits: int, group: int) -> int:
    """Bytes of one quantized row: codes plus an fp16 scale and zero per group (the rule of
    :func:`tandem.kernels.kv_quant.bytes_per_row`, restated here without torch)."""
    return -(-width // group) * (group * bits // 8 + 4)


def held_bytes(cfg: KVCompressConfig, *, n_layer: int, n_head_kv: int, head_dim: int, n_tokens: int,
               pass_tokens: int, engine_bytes: int = 4) -> int:
    """Most bytes a :class:`~tandem.runtime.kv.compress.CompressedKVCache` holds (what its
    ``nbytes()`` reports) with ``n_tokens`` in the sequence, when passes are at most
    ``pass_tokens`` long: eviction and key grouping are lazy (the next pass does them), so
    up to one pass's entries more than the kept tokens are held; CAKE's cascade evicts
    inside passes longer than its observation window."""
    w = n_head_kv * head_dim
    hold = 2 if cfg.hold == "float16" else engine_bytes
    sinks = min(cfg.sinks, n_tokens)
    extra = min(pass_tokens, cfg.window) if cfg.policy == "cake" and cfg.cascade else pass_tokens
    kept = {"none": n_tokens, "window": cfg.window + sinks, "cake": cfg.budget}[cfg.policy]
    body = max(0, min(n_tokens, kept + extra) - sinks)
    total = 2 * sinks * w * hold
    if cfg.bits is None:
        total += 2 * body * w * hold
    else:
        key_bits = cfg.key_bits or cfg.bits
        total += body * quantized_row_bytes(w, cfg.bits, cfg.group)
        if cfg.key_mode == "token":
            total += body * quantized_row_bytes(w, key_bits, cfg.group)
        else:
            full = min(body, cfg.key_group + cfg.residual)  # newest keys not yet in a group
            grouped = body - full
            total += grouped * w * key_bits // 8 + math.ceil(grouped / cfg.key_group) * (4 * w + 4) + full * w * hold
    if cfg.policy == "cake":  # running moments (fp16) per entry, and one pass's attention rows
        entries = sinks + body
        total += entries * (n_head_kv + 1) * 2 + n_head_kv * extra * entries * 2
    return n_layer * total
