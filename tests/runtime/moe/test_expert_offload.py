"""Expert offloading: exactness with a full cache, pinning, misprediction fallback, budgets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from greedy_runs import greedy_rows

from tandem.errors import UnsupportedModel
from tandem.runtime.backends.torch_engine.backend import TorchBackend, TorchConfig
from tandem.runtime.moe.config import OffloadConfig
from tandem.runtime.moe.expert_cache import ExpertCache, enable_offload
from tandem.runtime.moe.expert_store import ExpertWeights, GGUFExpertSource

TEXT = "Once upon a time, there was a little girl named Lily. She loved to play with her ball in the park."


@pytest.fixture()
def moe(stories_moe: Path) -> TorchBackend:
    return TorchBackend(stories_moe, TorchConfig(device="cpu", n_threads=1))


@pytest.mark.parametrize("source", ["gguf", "ram"])
def test_everything_cached_equals_unoffloaded(stories_moe: Path, moe: TorchBackend, source: str) -> None:
    ids = moe.tokenize(TEXT, add_bos=True)
    ref_tokens, ref_logits = greedy_rows(moe, ids, 16)
    b = TorchBackend(stories_moe, TorchConfig(device="cpu", n_threads=1))
    mgr = enable_offload(b, OffloadConfig(budget_bytes=1 << 30, prefetch=True), source=source)
    tokens, logits = greedy_rows(b, ids, 16)
    mgr.close()
    assert tokens == ref_tokens
    assert np.array_equal(logits, ref_logits)  # bit-identical: same kernels, same order
    assert mgr.stats.misses <= 5 * 8  # each expert loaded at most once


def test_small_budget_still_exact_and_counts(stories_moe: Path, moe: TorchBackend) -> None:
    """Evicting and reloading full-precision experts changes nothing but the I/O."""
    ids = moe.tokenize(TEXT, add_bos=True)
    ref_tokens, ref_logits = greedy_rows(moe, ids, 8)
    b = TorchBackend(stories_moe, TorchConfig(device="cpu", n_threads=1))
    one = GGUFExpertSource(stories_moe).load(0, 0)[0].nbytes
    mgr = enable_offload(b, OffloadConfig(budget_bytes=10 * one, prefetch=True))
    tokens, logits = greedy_rows(b, ids, 8)
    mgr.close()
    assert tokens == ref_tokens and np.array_equal(logits, ref_logits)
    s = mgr.stats
    assert mgr.cache.evictions > 0 and mgr.cache.used <= 10 * one
    assert 0 < s.hit_rate < 1 and s.bytes_loaded >= s.misses * one
    assert 0.0 <= s.prefetch_recall <= 1.0 and s.recall_by_layer


def test_misprediction_falls_back_to_synchronous_load(stories_moe: Path, moe: TorchBackend) -> None:
    ids = moe.tokenize(TEXT, add_bos=True)
    ref_tokens, ref_logits = greedy_rows(moe, ids, 6)
    b = TorchBackend(stories_moe, TorchConfig(device="cpu", n_threads=1))
    one = GGUFExpertSource(stories_moe).load(0, 0)[0].nbytes
    mgr = enable_offload(b, OffloadConfig(budget_bytes=6 * one, prefetch=True))
    # A deliberately wrong cross-layer gate: prefetch the experts the real router ranks last.
    mgr.routers = [-r for r in mgr.routers]
    tokens, logits = greedy_rows(b, ids, 6)
    mgr.close()
    assert tokens == ref_tokens and np.array_equal(logits, ref_logits)
    assert mgr.stats.prefetch_recall < 0.5 and mgr.stats.misses > 0


def test_expert_in_use_is_never_evicted() -> None:
    cfg = OffloadConfig(budget_bytes=3 * 4 * 3, eviction="hobbit")
    cache = ExpertCache(cfg, n_layer=2)

    def w() -> ExpertWeights:
        return ExpertWeights(torch.zeros(1), torch.zeros(1), torch.zeros(1))  # 12 bytes

    for e in range(3):
        assert cache.insert((0, e, False), w(), 0, prefetched=False)
    cache.pinned = {(0, 0, False), (0, 1, False), (0, 2, False)}
    assert not cache.insert((1, 5, False), w(), 0, prefetched=True)  # nothing evictable
    assert set(cache.entries) == cache.pinned
    cache.pinned = {(0, 0, False), (0, 2, False)}
    assert cache.insert((1, 5, False), w(), 0, prefetched=False)
    assert (0, 1, False) not in cache.entries and (0, 0, False) in cache.entries


def test_prefetch_only_replaces_experts_of_its_own_layer() -> None:
    """A guess for layer 1 may push out a layer-1 expert, never another layer's (nor an unused guess)."""
    cache = ExpertCache(OffloadConfig(budget_bytes=3 * 12), n_layer=3)

    def w() -> ExpertWeights:
        return ExpertWeights(torch.zeros(1), torch.zeros(1), torch.zeros(1))

    cache.insert((0, 0, False), w(), 0, prefetched=False)
    cache.insert((2, 0, False), w(), 0, prefetched=False)
    assert cache.insert((1, 3, False), w(), 0, prefetched=True)  # free room
    assert not cache.insert((1, 4, False), w(), 0, prefetched=True)  # only (1, 3), an unused guess, is in layer 1
    cache.entries[(1, 3, False)].prefetched = False  # used now
    assert cache.insert((1, 4, False), w(), 0, prefetched=True)
    assert set(cache.entries) == {(0, 0, False), (2, 0, False), (1, 4, False)}


def test_hobbit_prefers_evicting_far_layers_and_lru_recency() -> None:
    def w() -> ExpertWeights:
        return ExpertWeights(torch.zeros(1), torch.zeros(1), torch.zeros(1))

    for policy, victim in (("hobbit", (3, 0, False)), ("lru", (1, 0, False))):
        cache = ExpertCache(OffloadConfig(budget_bytes=24, eviction=policy), n_layer=4)
        cache.insert((1, 0, False), w(), 0, False)  # older, but its layer runs next
        cache.clock = 1
        cache.insert((3, 0, False), w(), 0, False)  # newer, but its layer is the farthest
        cache.clock = 2
        cache.insert((0, 1, False), w(), 0, False)
        assert victim not in cache.entries


def test_mixed_precision_uses_low_bit_copies(stories_moe: Path, moe: TorchBackend) -> None:
    ids = moe.tokenize(TEXT, add_bos=True)
    _, ref_logits = greedy_rows(moe, ids, 8)
    b = TorchBackend(stories_moe, TorchConfig(device="cpu", n_threads=1))
    one = GGUFExpertSource(stories_moe).load(0, 0)[0].nbytes
    mgr = enable_offload(b, OffloadConfig(budget_bytes=10 * one, mixed_precision=True, low_weight=0.55, low_bits=8))
    _, logits = greedy_rows(b, ids, 8)
    mgr.close()
    assert mgr.stats.low_precision > 0
    assert not np.array_equal(logits, ref_logits)
    np.testing.assert_allclose(logits, ref_logits, atol=0.5)  # 8-bit copies: a small, real cost


def test_dense_model_cannot_be_offloaded(stories260k: Path) -> None:
    b = TorchBackend(stories260k, TorchConfig(device="cpu", n_threads=1))
    with pytest.raises(UnsupportedModel):
        enable_offload(b, OffloadConfig(budget_bytes=1 << 20))


def test_widened_moe_computes_the_small_moe_and_routes_in_every_layer(stories_moe: Path, moe: TorchBackend,
                                                                      tmp_path: Path) -> None:
    """The benchmark's wide MoE: same function as its source, and no layer routes trivially."""
    from benchmarks.moe_model import widen_moe

    wide = TorchBackend(widen_moe(stories_moe, tmp_path / "wide.gguf", 128, 32, 8), TorchConfig(device="cpu", n_threads=1))
    assert (wide.model_config.n_embd, wide.model_config.n_ff_exp, wide.model_config.n_layer) == (128, 32, 8)
    ids = moe.tokenize(TEXT, add_bos=True)
    ref_tokens, ref_logits = greedy_rows(moe, ids, 12)
    mgr = enable_offload(wide, OffloadConfig(budget_bytes=1 << 30, prefetch=False))
    tokens, logits = greedy_rows(wide, ids, 12)
    assert tokens == ref_tokens
    np.testing.assert_allclose(logits, ref_logits, atol=1e-4)
    per_layer = [{k[1] for k in mgr.cache.entries if k[0] == layer} for layer in range(8)]
    assert all(len(used) >= 3 for used in per_layer)  # extra layers reuse trained routers
