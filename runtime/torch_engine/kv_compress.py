"""Compressed KV caches for the torch engine: sinks + window, CAKE budgets, RotateKV 4/2-bit.

One class, :class:`CompressedKVCache`, configured by :class:`KVCompressConfig`:

* ``policy="window"`` (StreamingLLM): keep the first ``sinks`` tokens and the most
  recent ``window``. **Positions are cache-relative**: the stored keys are post-RoPE,
  the window's keys are contiguous with the new queries already, and the sink keys are
  re-rotated (RoPE composes: ``R(a) R(b) = R(a + b)``) by the number of evicted tokens,
  so the attended keys always sit at contiguous positions ending right before the query.
* ``policy="cake"`` (CAKE): one total budget (``budget`` tokens per layer on average) is
  split over layers by attention entropy x variance over the last ``obs_window`` queries,
  and each layer keeps its sinks, the observation window and its highest-scoring tokens.
  Kept tokens are scattered, so CAKE keeps their **original positions** (as the paper).
* ``bits=4|2`` (RotateKV): keys are un-rotated to pre-RoPE, Hadamard-rotated across the
  KV heads of a token, quantized per token in groups (asymmetric min/max); values are
  Hadamard-rotated and quantized the same way. Reading dequantizes, un-rotates and
  re-applies RoPE at the (possibly cache-relative) position. Sink tokens stay full
  precision and are returned bit-exact.

**Rollback.** Eviction is lazy: it happens at the start of the next forward pass (each
layer's first ``update``), never in ``commit``. So ``trim(n)`` after a rejected draft
simply drops entries with logical index ``>= n``: every remaining entry is untouched,
and the next pass evicts exactly what it would have evicted had the drafts never been
evaluated. The cost is that between passes up to ``T`` (the last pass's length) extra
entries are held.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.kernels.hadamard import fwht, pow2_block
from tandem.kernels.kv_budget import (
    allocate_budgets,
    eviction_scores,
    layer_preference,
    select_keep,
)
from tandem.kernels.kv_quant import QuantizedRows, bytes_per_row, dequantize, quantize
from tandem.runtime.torch_engine.cache import KVCache
from tandem.runtime.torch_engine.config import ModelConfig
from tandem.runtime.torch_engine.llama import apply_rope, rope_tables

POLICIES = ("none", "window", "cake")


@dataclass(frozen=True)
class KVCompressConfig:
    policy: str = "window"
    sinks: int = 4
    window: int = 64
    """``window`` policy: recent tokens kept. ``cake``: the observation window (always kept)."""
    budget: int = 128
    """``cake`` policy: average tokens kept per layer (total = budget x layers)."""
    bits: int | None = None
    """4 or 2 for RotateKV quantization of non-sink entries; None keeps full precision."""
    key_bits: int | None = None
    """Bits for keys when they should differ from ``bits`` (keys set attention logits,
    which softmax amplifies, so they are the more sensitive half)."""
    group: int = 32
    rotate: bool = True
    """Hadamard rotation before quantizing (off: plain per-token quantization, ablation)."""
    cake_gamma: float = 200.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        for b in (self.bits, self.key_bits):
            if b not in (None, 2, 4, 8):
                raise ValueError(f"bits must be 2, 4, 8 or None, got {b}")
        if self.key_bits is not None and self.bits is None:
            raise ValueError("key_bits needs bits (the value bits) as well")
        if self.sinks < 0 or self.window < 1 or self.budget < 1:
            raise ValueError("sinks >= 0, window >= 1 and budget >= 1 are required")


@dataclass
class _Seg:
    """One layer's stored entries, token-major: k/v (n, H, D) floats or quantized rows."""

    pos: torch.Tensor
    logical: torch.Tensor
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    qk: QuantizedRows | None = None
    qv: QuantizedRows | None = None
    obs: torch.Tensor | None = None
    """CAKE: attention of the last queries over these entries, (heads, w, n)."""
    obs_rows: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))

    def __len__(self) -> int:
        return int(self.pos.shape[0])


def _cat_q(a: QuantizedRows | None, b: QuantizedRows) -> QuantizedRows:
    if a is None:
        return b
    return QuantizedRows(
        torch.cat((a.packed, b.packed)), torch.cat((a.scale, b.scale)), torch.cat((a.zero, b.zero)),
        b.bits, b.group, b.width,
    )


def _take_q(q: QuantizedRows, idx: torch.Tensor) -> QuantizedRows:
    return QuantizedRows(q.packed[idx], q.scale[idx], q.zero[idx], q.bits, q.group, q.width)


class CompressedKVCache(KVCache):
    """Sinks + window / CAKE eviction and RotateKV quantization behind the :class:`KVCache` calls."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        cfg: KVCompressConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        rope_freqs: torch.Tensor | None = None,
    ) -> None:
        self.n_layers, self.n_kv_heads, self.head_dim = model_cfg.n_layers, model_cfg.n_kv_heads, model_cfg.head_dim
        self.mcfg, self.cfg = model_cfg, cfg
        self.dtype, self.device = dtype, torch.device(device)
        self.rope_freqs = rope_freqs
        self.wants_attention = cfg.policy == "cake"
        width = self.n_kv_heads * self.head_dim
        if cfg.bits is not None and (width % cfg.group or (cfg.group * cfg.bits) % 8):
            raise ValueError(f"group {cfg.group} must divide the KV row width {width}")
        self._block = pow2_block(width)
        self._len = 0
        self._budgets: list[int] | None = None
        self.evicted = 0
        self.reset()

    # -- bookkeeping -------------------------------------------------------------------
    def reset(self) -> None:
        empty = torch.zeros(0, dtype=torch.long, device=self.device)
        self._sink = [_Seg(empty, empty) for _ in range(self.n_layers)]
        self._body = [_Seg(empty, empty) for _ in range(self.n_layers)]
        self._len = 0
        self._pending = [False] * self.n_layers
        self._budgets = None
        self.evicted = 0

    def stored(self, layer: int) -> int:
        """Entries physically held for ``layer`` (sinks + body)."""
        return len(self._sink[layer]) + len(self._body[layer])

    def positions(self, layer: int = 0) -> torch.Tensor:
        return torch.cat((self._sink[layer].pos, self._body[layer].pos))

    def logical(self, layer: int = 0) -> torch.Tensor:
        return torch.cat((self._sink[layer].logical, self._body[layer].logical))

    def nbytes(self) -> int:
        elem = torch.empty(0, dtype=self.dtype).element_size()
        width = self.n_kv_heads * self.head_dim
        total = 0
        for layer in range(self.n_layers):
            total += 2 * len(self._sink[layer]) * width * elem
            n = len(self._body[layer])
            if self.cfg.bits is None:
                total += 2 * n * width * elem
            else:
                key_bits = self.cfg.key_bits or self.cfg.bits
                total += n * (bytes_per_row(width, key_bits, self.cfg.group) + bytes_per_row(width, self.cfg.bits, self.cfg.group))
        return total

    # -- rotation helpers --------------------------------------------------------------
    def _rope(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Apply (or undo) RoPE to token-major (n, H, D) at ``positions``."""
        if x.shape[0] == 0:
            return x
        cos, sin = rope_tables(positions, self.mcfg.rotary_dim, self.mcfg.rope_theta, self.rope_freqs, x.dtype)
        return apply_rope(x, cos[:, None, :], (-sin if inverse else sin)[:, None, :])

    def _encode(self, x: torch.Tensor, bits: int) -> QuantizedRows:
        rows = x.reshape(x.shape[0], -1).float()
        if self.cfg.rotate:
            rows = fwht(rows, self._block)
        return quantize(rows, bits, self.cfg.group)

    def _decode(self, q: QuantizedRows) -> torch.Tensor:
        rows = dequantize(q)
        if self.cfg.rotate:
            rows = fwht(rows, self._block)  # orthonormal and symmetric: its own inverse
        return rows.reshape(-1, self.n_kv_heads, self.head_dim).to(self.dtype)

    # -- eviction ----------------------------------------------------------------------
    def _keep_body(self, layer: int, idx: torch.Tensor) -> None:
        seg = self._body[layer]
        self.evicted += len(seg) - int(idx.numel())
        seg.pos, seg.logical = seg.pos[idx], seg.logical[idx]
        if seg.k is not None:
            seg.k, seg.v = seg.k[idx], seg.v[idx]
        if seg.qk is not None:
            seg.qk, seg.qv = _take_q(seg.qk, idx), _take_q(seg.qv, idx)
        if seg.obs is not None:
            n_sink = len(self._sink[layer])
            seg.obs = torch.cat((seg.obs[..., :n_sink], seg.obs[..., n_sink + idx]), dim=-1)

    def _evict(self, layer: int) -> None:
        body = self._body[layer]
        n_sink = len(self._sink[layer])
        if self.cfg.policy == "window":
            if len(body) > self.cfg.window:
                self._keep_body(layer, torch.arange(len(body) - self.cfg.window, len(body)))
        elif self.cfg.policy == "cake" and body.obs is not None:
            # Rows beyond the observation window are dropped only now, so a rollback
            # before this pass could still restore the rows a draft pushed out.
            body.obs, body.obs_rows = body.obs[:, -self.cfg.window :], body.obs_rows[-self.cfg.window :]
            if layer == 0 or self._budgets is None:
                self._budgets = self._cake_budgets()
            budget = self._budgets[layer] - n_sink
            if len(body) > budget:
                scores = eviction_scores(body.obs[..., n_sink:], self.cfg.cake_gamma)
                keep = select_keep(scores, max(budget, 0), window=self.cfg.window)
                self._keep_body(layer, keep.to(self.device))

    def _cake_budgets(self) -> list[int]:
        prefs, lengths = [], []
        for layer in range(self.n_layers):
            obs = self._body[layer].obs
            obs = None if obs is None else obs[:, -self.cfg.window :]
            prefs.append(1.0 if obs is None or obs.shape[1] < 2 else layer_preference(obs))
            lengths.append(self.stored(layer))
        floor = min(self.cfg.sinks + self.cfg.window, self.cfg.budget)
        return allocate_budgets(prefs, self.cfg.budget * self.n_layers, lengths, floor=floor)

    # -- the engine's interface --------------------------------------------------------
    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._pending[layer]:
            self._evict(layer)
            self._pending[layer] = False
        t = k.shape[1]
        kt, vt = k.transpose(0, 1), v.transpose(0, 1)  # (T, H, D)
        logical = torch.arange(self._len, self._len + t, device=self.device)
        n_s = max(0, min(t, self.cfg.sinks - self._len))
        sink, body = self._sink[layer], self._body[layer]
        if n_s:
            sink.k = kt[:n_s].clone() if sink.k is None else torch.cat((sink.k, kt[:n_s]))
            sink.v = vt[:n_s].clone() if sink.v is None else torch.cat((sink.v, vt[:n_s]))
            sink.pos = torch.cat((sink.pos, positions[:n_s]))
            sink.logical = torch.cat((sink.logical, logical[:n_s]))
        if t > n_s:
            kb, vb, pb = kt[n_s:], vt[n_s:], positions[n_s:]
            if self.cfg.bits is None:
                body.k = kb.clone() if body.k is None else torch.cat((body.k, kb))
                body.v = vb.clone() if body.v is None else torch.cat((body.v, vb))
            else:
                key_bits = self.cfg.key_bits or self.cfg.bits
                body.qk = _cat_q(body.qk, self._encode(self._rope(kb, pb, inverse=True), key_bits))
                body.qv = _cat_q(body.qv, self._encode(vb, self.cfg.bits))
            body.pos = torch.cat((body.pos, pb))
            body.logical = torch.cat((body.logical, logical[n_s:]))
        return self._read(layer, t)

    def _read(self, layer: int, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        sink, body = self._sink[layer], self._body[layer]
        n_old = self.stored(layer) - t
        pos = torch.cat((sink.pos, body.pos))
        if self.cfg.policy == "window" and n_old > 0:
            # Cache-relative: the old entries sit right before the first new position.
            first_new = pos[n_old] if t else pos[-1] + 1
            pos = pos.clone()
            pos[:n_old] = first_new - n_old + torch.arange(n_old, device=self.device)
        ks, vs = [], []
        if len(sink):
            shift = pos[: len(sink)] - sink.pos
            ks.append(self._rope(sink.k, shift) if bool((shift != 0).any()) else sink.k)
            vs.append(sink.v)
        if len(body):
            if self.cfg.bits is None:
                ks.append(body.k)
                vs.append(body.v)
            else:
                ks.append(self._rope(self._decode(body.qk), pos[len(sink) :]))
                vs.append(self._decode(body.qv))
        k_all = torch.cat(ks).transpose(0, 1).to(self.dtype)
        v_all = torch.cat(vs).transpose(0, 1).to(self.dtype)
        return k_all, v_all, pos

    def observe_attention(self, layer: int, probs: torch.Tensor) -> None:
        """CAKE: keep the last ``window`` queries' attention over the stored entries."""
        seg = self._body[layer]
        n = probs.shape[-1]
        rows = probs.detach().float()
        old = seg.obs
        if old is not None and old.shape[-1] < n:
            old = torch.nn.functional.pad(old, (0, n - old.shape[-1]))
        obs = rows if old is None else torch.cat((old, rows), dim=1)
        new_rows = torch.arange(self._len, self._len + rows.shape[1], device=self.device)
        seg.obs_rows = torch.cat((seg.obs_rows.to(self.device), new_rows))
        seg.obs = obs

    def commit(self, n_new: int) -> None:
        self._len += n_new
        self._pending = [True] * self.n_layers

    def trim(self, n: int) -> None:
        n = max(0, min(n, self._len))
        for layer in range(self.n_layers):
            for seg in (self._sink[layer], self._body[layer]):
                keep = torch.nonzero(seg.logical < n).squeeze(-1)
                if keep.numel() == len(seg):
                    continue
                seg.pos, seg.logical = seg.pos[keep], seg.logical[keep]
                if seg.k is not None:
                    seg.k, seg.v = seg.k[keep], seg.v[keep]
                if seg.qk is not None:
                    seg.qk, seg.qv = _take_q(seg.qk, keep), _take_q(seg.qv, keep)
            self._trim_obs(layer, n)
        self._len = n

    def _trim_obs(self, layer: int, n: int) -> None:
        seg = self._body[layer]
        if seg.obs is None:
            return
        rows = seg.obs_rows < n
        seg.obs, seg.obs_rows = seg.obs[:, rows, : self.stored(layer)], seg.obs_rows[rows]
        if seg.obs.shape[1] == 0:
            seg.obs = None

    def keep(self, indices: list[int]) -> None:
        """Tree verification: keep logical entries ``indices`` of the suffix, renumbered."""
        if not indices:
            return
        start = min(indices)
        idx = torch.tensor(indices, device=self.device)
        for layer in range(self.n_layers):
            for seg in (self._sink[layer], self._body[layer]):
                old = seg.logical
                sel = torch.nonzero((old < start) | torch.isin(old, idx)).squeeze(-1)
                seg.pos, seg.logical = seg.pos[sel], old[sel]
                if seg.k is not None:
                    seg.k, seg.v = seg.k[sel], seg.v[sel]
                if seg.qk is not None:
                    seg.qk, seg.qv = _take_q(seg.qk, sel), _take_q(seg.qv, sel)
                tail = seg.logical >= start
                seg.logical = seg.logical.clone()
                seg.logical[tail] = start + torch.searchsorted(idx, seg.logical[tail])
            self._body[layer].obs, self._body[layer].obs_rows = None, self._body[layer].obs_rows[:0]
        self._len = start + len(indices)


def compressed_cache_factory(cfg: KVCompressConfig):
    """A ``TorchConfig.cache_factory`` building :class:`CompressedKVCache` with ``cfg``.

    The factory cannot see ``rope_freqs``: for models that have them (Llama 3.1) use
    :func:`use_compressed_cache`.
    """

    def build(model_cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> KVCache:
        return CompressedKVCache(model_cfg, cfg, dtype=dtype, device=device)

    return build


def use_compressed_cache(backend, cfg: KVCompressConfig) -> CompressedKVCache:
    """Swap a :class:`TorchBackend`'s cache for a compressed one (clears the sequence).

    Unlike the factory this passes the model's ``rope_freqs`` (Llama 3.1 scaling), which
    the re-rotation of keys must use.
    """
    backend.truncate(0)
    cache = CompressedKVCache(
        backend.model_config, cfg, dtype=backend.dtype, device=backend.device,
        rope_freqs=getattr(backend.model, "rope_freqs", None),
    )
    backend.cache = cache
    return cache
