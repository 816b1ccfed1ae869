"""Compressed KV caches for the torch engine: sinks + window, CAKE budgets, RotateKV / KIVI 8/4/2-bit.

One class, :class:`CompressedKVCache`, configured by :class:`KVCompressConfig`:

* ``policy="window"`` (StreamingLLM): keep the first ``sinks`` tokens and the most
  recent ``window``. **Positions are cache-relative**: the window's keys are contiguous
  with the new queries already, and the sink keys are re-rotated (RoPE composes:
  ``R(a) R(b) = R(a + b)``) by the number of evicted tokens, so the attended keys always
  sit at contiguous positions ending right before the query.
* ``policy="cake"`` (CAKE): one total budget (``budget`` tokens per layer on average) is
  split over layers by attention entropy x variance over the last ``window`` queries,
  and each layer keeps its sinks, the observation window and its highest-scoring tokens.
  The statistics are running moments per KV head and entry (``fold_moments``, horizon
  ``stat_window``), not the window's attention rows, which would take more memory than
  the entries they evict; they are counted in :meth:`nbytes`.
  Kept tokens are scattered, so CAKE keeps their **original positions** (as the paper).
  With ``cascade`` a long pass (a prefill chunk longer than the observation window)
  re-splits the budget over the layers processed so far after each layer and evicts at
  once, so the cache never holds more than the total budget after any layer.
* ``bits`` (values) / ``key_bits``: quantization of non-sink entries. Keys are un-rotated
  to pre-RoPE first unless ``pre_rope=False``. ``key_mode="token"`` (RotateKV): a key row is reordered by a
  calibrated channel permutation (:meth:`CompressedKVCache.set_key_order`), Hadamard-
  rotated and quantized per token in groups of ``group`` channels. ``key_mode="channel"``
  (KIVI): keys are quantized per channel over groups of ``key_group`` tokens; the newest
  tokens not yet forming a group stay full precision (counted in the bytes). Values are
  always per token (rotated when ``rotate``). Sink tokens stay full precision.
* ``hold="float16"`` stores the full-precision entries (sinks, residual keys, an
  unquantized body) in half precision, as an fp16 engine would.

**Rollback.** Eviction and key grouping are lazy: they happen at the start of the next
forward pass (each layer's first ``update``), never in ``commit``. So ``trim(n)`` after a
rejected draft simply drops entries with logical index ``>= n``: every remaining entry
is untouched, and the next pass evicts and groups exactly what it would have had the
drafts never been evaluated. The cost is that between passes up to ``T`` (the last
pass's length) extra entries are held. The one exception is CAKE's cascade, which
evicts inside a pass; it only acts on passes longer than the observation window
(prefill), never on a speculative verification of fewer drafts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tandem.kernels.hadamard import pow2_block, rotation_matrix
from tandem.kernels.kv_budget import (
    allocate_budgets,
    fold_moments,
    preference_from_moments,
    scores_from_moments,
    select_keep,
)
from tandem.runtime.backends.torch_engine.cache import KVCache
from tandem.runtime.backends.torch_engine.config import ModelConfig
from tandem.runtime.kv.config import KVCompressConfig
from tandem.runtime.kv.segments import CodecMixin, RopeTable, Seg, cat_opt, cat_q

if TYPE_CHECKING:
    from tandem.runtime.backends.torch_engine.backend import TorchBackend

HOLD_DTYPES = {None: None, "float16": torch.float16, "float32": torch.float32}


class CompressedKVCache(CodecMixin, KVCache):
    """Sinks + window / CAKE eviction and RotateKV / KIVI quantization behind the :class:`KVCache` calls."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        cfg: KVCompressConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        rope_freqs: torch.Tensor | None = None,
    ) -> None:
        self.n_layer, self.n_head_kv, self.head_dim = model_cfg.n_layer, model_cfg.n_head_kv, model_cfg.head_dim
        self.mcfg, self.cfg = model_cfg, cfg
        self.dtype, self.device = dtype, torch.device(device)
        self.hold = HOLD_DTYPES[cfg.hold] or dtype
        self.rope = RopeTable(model_cfg.rotary_dim, model_cfg.rope_theta, rope_freqs, dtype)
        self.wants_attention = cfg.policy == "cake"
        self.width = width = self.n_head_kv * self.head_dim
        if cfg.bits is not None and (width % cfg.group or (cfg.group * cfg.bits) % 8):
            raise ValueError(f"group {cfg.group} must divide the KV row width {width}")
        self._block = cfg.rot_block or pow2_block(width)
        self._rot: list[torch.Tensor | None] = [None] * self.n_layer
        self._key_rot: list[torch.Tensor | None] = [None] * self.n_layer
        if cfg.rotate:
            m = rotation_matrix(width, self._block).to(self.device)
            self._rot = [m] * self.n_layer
            self._key_rot = [m] * self.n_layer
        self.reset()

    def set_key_order(self, perms: list[torch.Tensor]) -> None:
        """RotateKV channel reordering: per layer, the key permutation applied before the rotation."""
        if len(perms) != self.n_layer:
            raise ValueError("one permutation per layer")
        self._key_rot = [rotation_matrix(self.width, self._block, p).to(self.device) for p in perms]

    # -- bookkeeping -------------------------------------------------------------------
    def reset(self) -> None:
        empty = torch.zeros(0, dtype=torch.long, device=self.device)
        self._sink = [Seg(empty, empty) for _ in range(self.n_layer)]
        self._body = [Seg(empty, empty) for _ in range(self.n_layer)]
        self._len = self._pass_start = 0
        self._pending = [False] * self.n_layer
        self._budgets: list[int] | None = None
        self.evicted = 0

    def stored(self, layer: int) -> int:
        """Entries physically held for ``layer`` (sinks + body)."""
        return len(self._sink[layer]) + len(self._body[layer])

    def positions(self, layer: int = 0) -> torch.Tensor:
        return torch.cat((self._sink[layer].pos, self._body[layer].pos))

    def logical(self, layer: int = 0) -> torch.Tensor:
        return torch.cat((self._sink[layer].logical, self._body[layer].logical))

    # -- eviction ----------------------------------------------------------------------
    def _keep_body(self, layer: int, idx: torch.Tensor) -> None:
        seg = self._body[layer]
        self.evicted += len(seg) - int(idx.numel())
        seg.take(idx)
        n_sink = len(self._sink[layer])
        cols = torch.cat((torch.arange(n_sink, device=self.device), n_sink + idx))
        if seg.obs is not None:
            seg.obs = seg.obs[..., cols]
        if seg.m1 is not None:
            seg.m1, seg.m2 = seg.m1[:, cols], seg.m2[cols]

    def _evict(self, layer: int) -> None:
        body = self._body[layer]
        if self.cfg.policy == "window":
            if len(body) > self.cfg.window:
                self._keep_body(layer, torch.arange(len(body) - self.cfg.window, len(body), device=self.device))
        elif self.cfg.policy == "cake" and (body.obs is not None or body.m1 is not None):
            if layer == 0 or self._budgets is None:
                self._budgets = self._cake_budgets(self.n_layer)
            self._cake_evict(layer, self._budgets[layer])

    def _fold(self, layer: int) -> None:
        """Move the last pass's attention rows into the running moments (only once no rollback can need them)."""
        seg = self._body[layer]
        if seg.obs is not None:
            m1, m2, seg.seen = fold_moments(seg.m1, seg.m2, seg.seen, seg.obs, self.cfg.stat_window)
            seg.m1, seg.m2 = m1.half(), m2.half()  # held in fp16: ranking needs no more
            seg.obs, seg.obs_rows = None, seg.obs_rows[:0]

    def _cake_evict(self, layer: int, budget: int) -> None:
        self._fold(layer)
        body = self._body[layer]
        n_sink = len(self._sink[layer])
        budget -= n_sink
        if body.m1 is not None and len(body) > budget:
            scores = scores_from_moments(body.m1[:, n_sink:], body.m2[n_sink:], self.cfg.cake_gamma)
            keep = select_keep(scores, max(budget, 0), window=self.cfg.window)
            self._keep_body(layer, keep.to(self.device))

    def _cake_budgets(self, n_layer: int) -> list[int]:
        """CAKE budgets for layers ``0 .. n_layer-1`` sharing the whole total (cascade: a prefix)."""
        prefs, lengths = [], []
        for layer in range(n_layer):
            self._fold(layer)
            body = self._body[layer]
            prefs.append(1.0 if body.m1 is None or body.seen < 2 else preference_from_moments(body.m1, body.m2))
            lengths.append(self.stored(layer))
        floor = min(self.cfg.sinks + self.cfg.window, self.cfg.budget)
        return allocate_budgets(prefs, self.cfg.budget * self.n_layer, lengths, floor=floor)

    # -- the engine's interface --------------------------------------------------------
    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._pending[layer]:
            self._evict(layer)
            if self.cfg.bits is not None and self.cfg.key_mode == "channel":
                self._form_groups(layer)
            self._pending[layer] = False
        t = k.shape[1]
        kt, vt = k.transpose(0, 1), v.transpose(0, 1)  # (T, H, D)
        logical = torch.arange(self._len, self._len + t, device=self.device)
        n_s = max(0, min(t, self.cfg.sinks - self._len))
        sink, body = self._sink[layer], self._body[layer]
        if n_s:
            sink.k, sink.v = cat_opt(sink.k, kt[:n_s].to(self.hold)), cat_opt(sink.v, vt[:n_s].to(self.hold))
            sink.pos = torch.cat((sink.pos, positions[:n_s]))
            sink.logical = torch.cat((sink.logical, logical[:n_s]))
        if t > n_s:
            kb, vb, pb = kt[n_s:], vt[n_s:], positions[n_s:]
            if self.cfg.bits is None:
                body.k, body.v = cat_opt(body.k, kb.to(self.hold)), cat_opt(body.v, vb.to(self.hold))
            else:
                pre = self.rope.apply(kb, pb, inverse=True) if self.cfg.pre_rope else kb
                if self.cfg.key_mode == "token":
                    body.qk = cat_q(body.qk, self._encode(pre, self.key_bits, self._key_rot[layer]))
                else:
                    body.rk = cat_opt(body.rk, pre.to(self.hold))
                body.qv = cat_q(body.qv, self._encode(vb, self.cfg.bits, self._rot[layer]))
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
            sk = sink.k.to(self.dtype)
            ks.append(self.rope.apply(sk, shift) if bool((shift != 0).any()) else sk)
            vs.append(sink.v.to(self.dtype))
        if len(body):
            if self.cfg.bits is None:
                ks.append(body.k.to(self.dtype))
                vs.append(body.v.to(self.dtype))
            else:
                keys, at = self._body_keys(layer), pos[len(sink) :]
                if self.cfg.pre_rope:
                    keys = self.rope.apply(keys, at)
                elif bool((at != body.pos).any()):  # stored at their own positions; move if needed
                    keys = self.rope.apply(keys, at - body.pos)
                ks.append(keys)
                vs.append(self._decode(body.qv, self._rot[layer]))
        k_all = (torch.cat(ks) if len(ks) > 1 else ks[0]).transpose(0, 1)
        v_all = (torch.cat(vs) if len(vs) > 1 else vs[0]).transpose(0, 1)
        return k_all, v_all, pos

    def observe_attention(self, layer: int, probs: torch.Tensor) -> None:
        """CAKE: hold this pass's attention (averaged per KV head) until the next pass; cascade in long passes."""
        seg = self._body[layer]
        h, t, n = probs.shape
        # Held raw until the next pass folds them (a rollback may cut into this pass).
        rows = probs.detach().float().view(self.n_head_kv, h // self.n_head_kv, t, n).mean(dim=1).half()
        old = seg.obs
        if old is not None and old.shape[-1] < n:
            old = torch.nn.functional.pad(old, (0, n - old.shape[-1]))
        seg.obs = rows if old is None else torch.cat((old, rows), dim=1)
        seg.obs_rows = torch.cat((seg.obs_rows.to(self.device), torch.arange(self._len, self._len + t, device=self.device)))
        if self.cfg.cascade and t > self.cfg.window:
            budgets = self._cake_budgets(layer + 1)
            for i in range(layer + 1):
                self._cake_evict(i, budgets[i])

    def commit(self, n_new: int) -> None:
        self._pass_start = self._len
        self._len += n_new
        self._pending = [True] * self.n_layer

    def _select(self, pred) -> None:
        """Keep, in every layer, the entries whose logical index satisfies ``pred`` (a tensor op).

        CAKE's statistics follow: the pending attention rows (queries, by logical index)
        and every column (stored entries) are filtered by the same predicate, so accepting
        a tree branch leaves the statistics a plain evaluation of the branch would have.
        """
        for layer in range(self.n_layer):
            sink, body = self._sink[layer], self._body[layer]
            masks = [pred(seg.logical) for seg in (sink, body)]
            cols = torch.cat(masks)
            if body.obs is not None:
                rows = pred(body.obs_rows)
                body.obs, body.obs_rows = body.obs[:, rows][..., cols[: body.obs.shape[-1]]], body.obs_rows[rows]
                if body.obs.shape[1] == 0:
                    body.obs = None
            if body.m1 is not None:
                keep = cols[: body.m1.shape[-1]]
                body.m1, body.m2 = body.m1[:, keep], body.m2[keep]
            for seg, mask in zip((sink, body), masks, strict=True):
                if not bool(mask.all()):
                    seg.take(torch.nonzero(mask).squeeze(-1))

    def trim(self, n: int) -> None:
        n = max(0, min(n, self._len))
        self._select(lambda logical: logical < n)
        self._len = n
        self._pass_start = min(self._pass_start, n)

    def keep(self, indices: list[int]) -> None:
        """Tree verification: keep the prefix and the last pass's nodes ``indices``, renumbered (see :class:`KVCache`)."""
        start = self._tree_prefix(indices)
        idx = torch.tensor(indices, dtype=torch.long, device=self.device)
        self._select(lambda logical: (logical < start) | torch.isin(logical, idx))

        def renumber(logical: torch.Tensor) -> torch.Tensor:
            tail = logical >= start
            out = logical.clone()
            out[tail] = start + torch.searchsorted(idx, logical[tail])
            return out

        for layer in range(self.n_layer):
            for seg in (self._sink[layer], self._body[layer]):
                seg.logical = renumber(seg.logical)
            self._body[layer].obs_rows = renumber(self._body[layer].obs_rows)
        self._len = self._pass_start = start + len(indices)


def use_compressed_cache(backend: TorchBackend, cfg: KVCompressConfig) -> CompressedKVCache:
    """Swap a :class:`TorchBackend`'s cache for a compressed one (clears the sequence).

    Unlike the factory this passes the model's ``rope_freqs`` (Llama 3.1 scaling), which
    the re-rotation of keys must use.
    """
    backend.truncate(0)
    cache = CompressedKVCache(
        backend.model_config, cfg, dtype=backend.dtype, device=backend.device,
        rope_freqs=backend.model.rope_freqs,
    )
    backend.cache = cache
    return cache
