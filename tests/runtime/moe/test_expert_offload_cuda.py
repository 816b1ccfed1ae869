"""Expert offloading with the cache on a CUDA device (skipped where torch sees no GPU).

The cache holds GPU tensors, the experts stay in host RAM (pinned) or the GGUF mmap,
prefetch copies run on a side stream and the compute stream waits on per-expert events.
What must hold there as on CPU: full-precision offloading is bit-identical to the
resident model, an expert in use is never evicted (on a GPU a violation would let a
prefetch copy overwrite memory a running kernel reads), and a wrong prefetch guess
falls back to a synchronous load, all without a host-wide synchronisation per token.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from greedy_runs import greedy_rows

from tandem.runtime.backends.torch_engine.backend import TorchBackend, TorchConfig
from tandem.runtime.moe.config import OffloadConfig
from tandem.runtime.moe.expert_cache import ExpertCache, enable_offload
from tandem.runtime.moe.expert_store import ExpertWeights, GGUFExpertSource

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="torch sees no CUDA device: the GPU expert cache needs one"
)

TEXT = "Once upon a time, there was a little girl named Lily. She loved to play with her ball in the park."


@pytest.fixture()
def reference(stories_moe: Path) -> tuple[list[int], list[int], np.ndarray]:
    b = TorchBackend(stories_moe, TorchConfig(device="cuda"))
    ids = b.tokenize(TEXT, add_bos=True)
    return (ids, *greedy_rows(b, ids, 12))


def _one(path: Path) -> int:
    return GGUFExpertSource(path).load(0, 0)[0].nbytes


def _no_host_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail if the offloading code calls a host-wide CUDA synchronisation."""
    def boom(*_a: object, **_k: object) -> None:
        raise AssertionError("host synchronisation on the hot path")

    monkeypatch.setattr(torch.cuda, "synchronize", boom)
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", boom)
    monkeypatch.setattr(torch.cuda.Event, "synchronize", boom)


@pytest.mark.parametrize(("source", "n_experts"), [("ram", 40), ("gguf", 40), ("ram", 10), ("ram", 0)])
def test_full_precision_offload_on_cuda_equals_in_memory(
    stories_moe: Path, reference: tuple, source: str, n_experts: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All cached, a 25 % budget with evictions, and load-on-demand (budget 0): identical output."""
    ids, ref_tokens, ref_logits = reference
    b = TorchBackend(stories_moe, TorchConfig(device="cuda"))
    one = _one(stories_moe)
    mgr = enable_offload(b, OffloadConfig(budget_bytes=n_experts * one, prefetch=n_experts > 0), source=source)
    with monkeypatch.context() as m:
        _no_host_sync(m)
        tokens, logits = greedy_rows(b, ids, 12)
    mgr.close()
    assert tokens == ref_tokens
    assert np.array_equal(logits, ref_logits)  # same kernels, same order, same device
    assert mgr.cache.used <= n_experts * one
    assert all(e.weights.gate.device.type == "cuda" for e in mgr.cache.entries.values())
    if n_experts == 40:
        assert mgr.stats.misses + mgr.stats.prefetch_loads <= 40  # each expert crosses PCIe once
    if n_experts == 10:
        assert mgr.cache.evictions > 0 and mgr.stats.prefetch_hits > 0


def test_expert_in_use_is_never_evicted_on_cuda(stories_moe: Path, reference: tuple) -> None:
    """A budget of exactly one layer's experts, prefetching the next: every insert would like to
    evict the running layer's experts; none may go, and the output stays exact."""
    ids, ref_tokens, ref_logits = reference
    b = TorchBackend(stories_moe, TorchConfig(device="cuda"))
    mgr = enable_offload(b, OffloadConfig(budget_bytes=2 * _one(stories_moe), prefetch=True), source="ram")
    cache, insert = mgr.cache, mgr.cache.insert
    checked = [0]

    def checked_insert(key, weights, current_layer, prefetched, ready=None):  # noqa: ANN001, ANN202
        held = {k for k in cache.pinned if k in cache.entries}
        ok = insert(key, weights, current_layer, prefetched, ready)
        assert held <= set(cache.entries), f"evicted an expert in use: {held - set(cache.entries)}"
        checked[0] += bool(held)
        return ok

    cache.insert = checked_insert  # type: ignore[method-assign]
    tokens, logits = greedy_rows(b, ids, 12)
    mgr.close()
    assert checked[0] > 0 and cache.evictions > 0
    assert tokens == ref_tokens and np.array_equal(logits, ref_logits)

    unit = ExpertCache(OffloadConfig(budget_bytes=3 * 12), n_layer=2)

    def w() -> ExpertWeights:
        return ExpertWeights(*(torch.zeros(1, device="cuda") for _ in range(3)))  # 12 bytes

    for e in range(3):
        assert unit.insert((0, e, False), w(), 0, prefetched=False)
    unit.pinned = {(0, 0, False), (0, 1, False), (0, 2, False)}
    assert not unit.insert((1, 5, False), w(), 0, prefetched=True)
    assert set(unit.entries) == unit.pinned


def test_misprediction_falls_back_to_synchronous_load_on_cuda(
    stories_moe: Path, reference: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids, ref_tokens, ref_logits = reference
    b = TorchBackend(stories_moe, TorchConfig(device="cuda"))
    mgr = enable_offload(b, OffloadConfig(budget_bytes=6 * _one(stories_moe), prefetch=True), source="ram")
    mgr.routers = [-r for r in mgr.routers]  # prefetch what the real router ranks last
    with monkeypatch.context() as m:
        _no_host_sync(m)
        tokens, logits = greedy_rows(b, ids, 12)
    mgr.close()
    assert tokens == ref_tokens and np.array_equal(logits, ref_logits)
    s = mgr.stats
    assert s.prefetch_recall < 0.5 and s.prefetch_loads > 0 and s.misses > 0


def test_low_bit_copies_are_dequantized_on_the_gpu(stories_moe: Path, reference: tuple) -> None:
    ids, _, ref_logits = reference
    b = TorchBackend(stories_moe, TorchConfig(device="cuda"))
    cfg = OffloadConfig(budget_bytes=10 * _one(stories_moe), mixed_precision=True, low_weight=0.55, low_bits=8)
    mgr = enable_offload(b, cfg, source="ram")
    _, logits = greedy_rows(b, ids, 12)
    mgr.close()
    low = [e for k, e in mgr.cache.entries.items() if k[2]]
    assert mgr.stats.low_precision > 0 and low and all(e.weights.up.device.type == "cuda" for e in low)
    np.testing.assert_allclose(logits, ref_logits, atol=0.5)  # 8-bit copies: a small, real cost
