"""Storage segments for :mod:`.compress`: one layer's entries (full precision or quantized), RoPE tables, calibration.

A :class:`Seg` holds one layer's sink or body entries token-major, in logical order.
Every way a cache shrinks (eviction, rollback, tree acceptance) is an index selection
(:meth:`Seg.take`), so all of them treat every storage format alike.

Keys in ``channel`` mode (KIVI) live in two parts: the oldest body tokens as packed
per-token codes that point into per-channel step/minimum tables, one per token group
(``kc``/``kg``/``kstep``/``klo``), followed by a full-precision residual ``rk`` of the
newest tokens, not yet forming a full group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from tandem.kernels.kv_quant import (
    QuantizedRows,
    bytes_per_row,
    channel_group_bytes,
    dequantize,
    dequantize_channels,
    quantize,
    quantize_channels,
)
from tandem.runtime.backends.torch_engine.decoder import apply_rope, rope_tables

if TYPE_CHECKING:
    from tandem.runtime.backends.torch_engine.backend import TorchBackend


def cat_q(a: QuantizedRows | None, b: QuantizedRows) -> QuantizedRows:
    if a is None:
        return b
    return QuantizedRows(
        torch.cat((a.packed, b.packed)), torch.cat((a.scale, b.scale)), torch.cat((a.zero, b.zero)),
        b.bits, b.group, b.width,
    )


def take_q(q: QuantizedRows, idx: torch.Tensor) -> QuantizedRows:
    return QuantizedRows(q.packed[idx], q.scale[idx], q.zero[idx], q.bits, q.group, q.width)


def cat_opt(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    return b.clone() if a is None else torch.cat((a, b))


@dataclass
class Seg:
    """One layer's stored entries, token-major: k/v (n, H, D) floats or quantized rows."""

    pos: torch.Tensor
    logical: torch.Tensor
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    qk: QuantizedRows | None = None
    qv: QuantizedRows | None = None
    kc: torch.Tensor | None = None
    """Channel mode: packed key codes of the quantized tokens (the first ``n_q``), (n_q, W*bits/8)."""
    kg: torch.Tensor | None = None
    """Channel mode: each quantized token's group, an index into ``kstep``/``klo`` (n_q,)."""
    kstep: torch.Tensor | None = None
    klo: torch.Tensor | None = None
    rk: torch.Tensor | None = None
    """Channel mode: full-precision pre-RoPE keys of the newest, not yet grouped tokens."""
    obs: torch.Tensor | None = None
    """CAKE: attention rows of the last pass not yet folded into the moments, (kv heads, T, n)."""
    obs_rows: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    m1: torch.Tensor | None = None
    """CAKE: running mean attention per KV head and entry (kv heads, n), see ``fold_moments``."""
    m2: torch.Tensor | None = None
    """CAKE: running head-averaged second moment of attention per entry (n,)."""
    seen: int = 0

    def __len__(self) -> int:
        return int(self.pos.shape[0])

    @property
    def n_q(self) -> int:
        return 0 if self.kc is None else int(self.kc.shape[0])

    @property
    def n_groups(self) -> int:
        return 0 if self.kstep is None else int(self.kstep.shape[0])

    def take(self, idx: torch.Tensor) -> None:
        """Keep only entries ``idx`` (ascending storage indices); obs is the caller's business."""
        self.pos, self.logical = self.pos[idx], self.logical[idx]
        if self.k is not None:
            self.k, self.v = self.k[idx], self.v[idx]
        if self.qk is not None:
            self.qk = take_q(self.qk, idx)
        if self.qv is not None:
            self.qv = take_q(self.qv, idx)
        if self.kc is not None or self.rk is not None:
            n_q = self.n_q
            in_q, in_r = idx[idx < n_q], idx[idx >= n_q] - n_q
            if self.rk is not None:
                self.rk = self.rk[in_r]
            if self.kc is not None:
                self.kc, kg = self.kc[in_q], self.kg[in_q]
                live, self.kg = torch.unique(kg, return_inverse=True)  # drop groups nobody uses
                self.kstep, self.klo = self.kstep[live], self.klo[live]

    def add_group(self, codes: torch.Tensor, step: torch.Tensor, lo: torch.Tensor) -> None:
        """Move the oldest ``len(codes)`` residual keys into a new quantized group."""
        n = codes.shape[0]
        gid = torch.full((n,), self.n_groups, dtype=torch.long, device=codes.device)
        self.kc, self.kg = cat_opt(self.kc, codes), cat_opt(self.kg, gid)
        self.kstep, self.klo = cat_opt(self.kstep, step[None]), cat_opt(self.klo, lo[None])
        self.rk = self.rk[n:]


class CodecMixin:
    """Byte accounting and (de)quantization of :class:`~.kv_compress.CompressedKVCache` bodies.

    A mixin so the cache module stays about eviction and the engine interface; it reads
    the cache's ``cfg``, ``width``, ``hold``, ``dtype``, rotations and segments.
    """

    cfg: Any
    width: int
    n_layer: int
    n_head_kv: int
    head_dim: int
    hold: torch.dtype
    dtype: torch.dtype
    _sink: list[Seg]
    _body: list[Seg]
    _key_rot: list[torch.Tensor | None]

    @property
    def key_bits(self) -> int:
        return self.cfg.key_bits or self.cfg.bits

    def nbytes(self) -> int:
        """Bytes of every key/value code, scale, minimum and full-precision entry held, and CAKE's statistics.

        Per-channel key groups count their step/minimum tables and one int32 token count
        each (group membership is a run-length over the token order).
        """
        elem = torch.empty(0, dtype=self.hold).element_size()
        w, cfg = self.width, self.cfg
        total = 0
        for layer in range(self.n_layer):
            sink, body = self._sink[layer], self._body[layer]
            for stat in (body.m1, body.m2, body.obs):  # CAKE's statistics are memory too
                total += 0 if stat is None else stat.numel() * stat.element_size()
            total += 2 * len(sink) * w * elem
            n = len(body)
            if cfg.bits is None:
                total += 2 * n * w * elem
                continue
            total += n * bytes_per_row(w, cfg.bits, cfg.group)
            if cfg.key_mode == "token":
                total += n * bytes_per_row(w, self.key_bits, cfg.group)
            else:
                total += body.n_q * w * self.key_bits // 8 + body.n_groups * (channel_group_bytes(w) + 4)
                total += (n - body.n_q) * w * elem
        return total

    def _encode(self, x: torch.Tensor, bits: int, rot: torch.Tensor | None):
        rows = x.reshape(x.shape[0], -1).float()
        return quantize(rows if rot is None else rows @ rot, bits, self.cfg.group)

    def _decode(self, q, rot: torch.Tensor | None) -> torch.Tensor:
        rows = dequantize(q)
        rows = rows if rot is None else rows @ rot.T
        return rows.reshape(-1, self.n_head_kv, self.head_dim).to(self.dtype)

    def _body_keys(self, layer: int) -> torch.Tensor:
        """The body's dequantized keys as stored (pre- or post-RoPE), (n, H, D) in the engine dtype."""
        body = self._body[layer]
        if self.cfg.key_mode == "token":
            return self._decode(body.qk, self._key_rot[layer])
        parts = []
        if body.n_q:
            rows = dequantize_channels(body.kc, self.key_bits, body.kstep[body.kg], body.klo[body.kg], self.dtype)
            parts.append(rows.reshape(-1, self.n_head_kv, self.head_dim))
        if body.rk is not None and body.rk.shape[0]:
            parts.append(body.rk.to(self.dtype))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _form_groups(self, layer: int) -> None:
        """KIVI: quantize the oldest residual keys in whole groups of ``key_group`` tokens."""
        body, g = self._body[layer], self.cfg.key_group
        while body.rk is not None and body.rk.shape[0] >= g + self.cfg.residual:
            body.add_group(*quantize_channels(body.rk[:g].reshape(g, -1), self.key_bits))



class RopeTable:
    """cos/sin rows by position, computed once (grown by doubling) instead of on every read.

    Compressed caches re-apply RoPE to every stored key each step (pre-RoPE storage,
    cache-relative positions); recomputing float64 angles for the whole cache was a
    noticeable share of the per-step time. The values are exactly those of
    :func:`rope_tables` (same function, gathered).
    """

    def __init__(self, rotary_dim: int, theta: float, freqs: torch.Tensor | None, dtype: torch.dtype) -> None:
        self.args = (rotary_dim, theta, freqs, dtype)
        self.cos = self.sin = torch.zeros(0, rotary_dim // 2, dtype=dtype)

    def _ensure(self, n: int, device: torch.device) -> None:
        if n <= self.cos.shape[0]:
            return
        size = max(64, self.cos.shape[0])
        while size < n:
            size *= 2
        self.cos, self.sin = rope_tables(torch.arange(size, device=device), *self.args)

    def apply(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Rotate token-major (n, H, D) ``x`` by the angles of ``positions`` (undo with ``inverse``)."""
        if x.shape[0] == 0:
            return x
        mag = positions.abs()
        self._ensure(int(mag.max()) + 1, x.device)
        cos, sin = self.cos[mag].to(x.dtype), self.sin[mag].to(x.dtype)
        if bool((positions < 0).any()):  # cos is even, sin odd
            sin = sin * positions.sign().clamp_min(-1).to(x.dtype)[:, None]
        return apply_rope(x, cos[:, None, :], (-sin if inverse else sin)[:, None, :])


def calibrate_key_scales(backend: TorchBackend, tokens: list[int]) -> list[torch.Tensor]:
    """Per layer, the largest |pre-RoPE key| of each channel (width H*D) over ``tokens``.

    Runs the backend's *full* cache over calibration text (use text other than what is
    evaluated, e.g. the model's own generation) and leaves the backend empty. Feeds
    :func:`tandem.kernels.hadamard.balanced_permutation` (RotateKV's channel reordering).
    """
    backend.truncate(0)
    backend.evaluate(tokens)
    cache, cfg = backend.cache, backend.model_config
    n = len(tokens)
    table = RopeTable(cfg.rotary_dim, cfg.rope_theta, backend.model.rope_freqs, torch.float64)
    scales = []
    for layer in range(cfg.n_layer):
        k = cache._k[layer][:, :n].transpose(0, 1).double()  # (n, H, D), post-RoPE
        pre = table.apply(k, cache.positions()[:n], inverse=True)
        scales.append(pre.reshape(n, -1).abs().amax(dim=0).float())
    backend.truncate(0)
    return scales
