"""Compressed KV caches in the torch engine, and llama.cpp's quantized KV types."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from greedy_runs import greedy_rows

from tandem.runtime.backends.torch_engine.backend import TorchBackend, TorchConfig
from tandem.runtime.backends.torch_engine.cache import KVCache
from tandem.runtime.kv.compress import CompressedKVCache, use_compressed_cache
from tandem.runtime.kv.config import KVCompressConfig

PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play"


def _backend(path: Path, cfg: KVCompressConfig | None) -> TorchBackend:
    b = TorchBackend(path, TorchConfig(device="cpu", n_threads=1))
    if cfg is not None:
        use_compressed_cache(b, cfg)
    return b


def _greedy(b: TorchBackend, n: int) -> tuple[list[int], np.ndarray]:
    return greedy_rows(b, b.tokenize(PROMPT, add_bos=True), n)


def test_window_larger_than_text_is_bit_identical(stories260k: Path) -> None:
    ref_tokens, ref_logits = _greedy(_backend(stories260k, None), 24)
    tokens, logits = _greedy(_backend(stories260k, KVCompressConfig(sinks=4, window=1000)), 24)
    assert tokens == ref_tokens
    assert np.array_equal(logits, ref_logits)


def test_sinks_kept_length_bounded_positions_contiguous(stories260k: Path) -> None:
    sinks, window = 4, 8
    full = _backend(stories260k, None)
    b = _backend(stories260k, KVCompressConfig(sinks=sinks, window=window))
    cache: CompressedKVCache = b.cache
    seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    original = cache.update

    def spy(layer, k, v, positions):
        k_all, v_all, pos = original(layer, k, v, positions)
        if layer == 0:
            seen.append((k.shape[1], pos.clone(), k_all[:, :sinks].clone()))
        return k_all, v_all, pos

    cache.update = spy  # type: ignore[method-assign]
    ids = b.tokenize(PROMPT, add_bos=True)
    full.evaluate(ids)
    b.evaluate(ids)
    for _ in range(20):
        t = int(b.evaluate([7])[-1].argmax()) % 100 + 3
        b.evaluate([t])
        full.evaluate([7, t])
    assert len(b.tokens) == len(full.tokens) > 3 * (sinks + window)
    for layer in range(cache.n_layer):
        assert cache.logical(layer)[:sinks].tolist() == list(range(sinks))
        assert cache.stored(layer) <= sinks + window + 1  # + the last pass's token
    for t, pos, _ in seen[1:]:
        n_old = pos.shape[0] - t
        assert n_old <= sinks + window
        assert torch.equal(pos, pos[0] + torch.arange(pos.shape[0]))  # contiguous, cache-relative
    # The sink keys were re-rotated by the shift; un-shifting gives the full cache's keys.
    sink_k = cache._sink[0].k.transpose(0, 1)
    assert torch.equal(sink_k, full.cache._k[0][:, :sinks])


@pytest.mark.parametrize("bits,key_bits", [(4, None), (2, 4)])
def test_quantized_sinks_are_bit_exact_and_body_close(stories260k: Path, bits: int, key_bits: int | None) -> None:
    full = _backend(stories260k, None)
    b = _backend(stories260k, KVCompressConfig(policy="none", sinks=4, bits=bits, key_bits=key_bits, group=16))
    ids = b.tokenize(PROMPT, add_bos=True)
    full.evaluate(ids)
    got = {}
    original = b.cache.update

    def spy(layer, k, v, positions):
        out = original(layer, k, v, positions)
        got[layer] = out
        return out

    b.cache.update = spy  # type: ignore[method-assign]
    b.evaluate(ids)
    for layer in range(b.cache.n_layer):
        k_all, v_all, _ = got[layer]
        n = len(ids)
        if layer:  # deeper layers see hidden states already perturbed by quantized attention
            assert torch.equal(k_all[:, :4], full.cache._k[layer][:, :4])
            continue
        ref_k, ref_v = full.cache._k[layer][:, :n], full.cache._v[layer][:, :n]
        assert torch.equal(k_all[:, :4], ref_k[:, :4]) and torch.equal(v_all[:, :4], ref_v[:, :4])
        rel_k = (k_all[:, 4:] - ref_k[:, 4:]).norm() / ref_k[:, 4:].norm()
        rel_v = (v_all[:, 4:] - ref_v[:, 4:]).norm() / ref_v[:, 4:].norm()
        # Uniform b-bit quantization of a row: RMS error about range / (2^b - 1) / sqrt(12),
        # i.e. roughly 7% of the norm at 4 bits and 35% at 2 bits for Gaussian-like rows.
        assert rel_k < {2: 0.5, 4: 0.12}[key_bits or bits]
        assert rel_v < {2: 0.5, 4: 0.12}[bits]
    full_bytes = 2 * len(ids) * b.cache.n_layer * b.model_config.kv_width * 4
    assert b.cache.nbytes() < full_bytes / 2.5  # 4 of 21 tokens are full-precision sinks


CONFIGS = [
    KVCompressConfig(policy="window", sinks=4, window=10),
    KVCompressConfig(policy="cake", sinks=4, window=6, budget=16),
    KVCompressConfig(policy="none", bits=4, group=16),
    KVCompressConfig(policy="window", sinks=2, window=10, bits=2, key_bits=4, group=16),
    KVCompressConfig(policy="none", bits=4, group=16, key_mode="channel", key_group=4),
    KVCompressConfig(policy="window", sinks=4, window=10, bits=4, key_mode="channel", key_group=4, residual=2,
                     hold="float16", pre_rope=False),
    KVCompressConfig(policy="cake", sinks=4, window=6, budget=14, bits=4, key_bits=8, key_mode="channel",
                     key_group=4),
    KVCompressConfig(policy="none", bits=4, group=8, rot_block=8, hold="float16"),
]


def _cfg_id(c: KVCompressConfig | None) -> str:
    return "full" if c is None else f"{c.policy}-{c.bits}-{c.key_mode}-{c.hold}-{'pre' if c.pre_rope else 'post'}"


@pytest.mark.parametrize("cfg", CONFIGS, ids=_cfg_id)
def test_rollback_is_exact(stories260k: Path, cfg: KVCompressConfig) -> None:
    """Drafts evaluated then trimmed leave no trace: the next logits equal a no-draft run."""
    a, b = _backend(stories260k, cfg), _backend(stories260k, cfg)
    ids = a.tokenize(PROMPT, add_bos=True)
    a.evaluate(ids)
    b.evaluate(ids)
    for step in range(3):
        a.evaluate([11 + step, 12, 13, 14])  # drafts, all rejected
        a.truncate(len(b.tokens))
        x = [20 + step]
        la, lb = a.evaluate(x), b.evaluate(x)
        assert np.array_equal(la, lb)
    for layer in range(a.cache.n_layer):
        assert torch.equal(a.cache.positions(layer), b.cache.positions(layer))


@pytest.mark.parametrize("cfg", CONFIGS, ids=_cfg_id)
def test_partial_acceptance_equals_accepted_tokens_alone(stories260k: Path, cfg: KVCompressConfig) -> None:
    """A verify pass whose drafts are partly accepted leaves the cache of a pass of the accepted tokens."""
    a, b = (TorchBackend(stories260k, TorchConfig(device="cpu", dtype="float64", n_threads=1)) for _ in range(2))
    use_compressed_cache(a, cfg)
    use_compressed_cache(b, cfg)
    ids = a.tokenize(PROMPT, add_bos=True)
    a.evaluate(ids)
    b.evaluate(ids)
    for step in range(6):
        x = [20 + step, 30 + step]
        a.evaluate([*x, 60, 61, 62][: 2 + step % 3 + 1])  # 1..3 drafts after the accepted two
        a.truncate(len(b.tokens) + 2)
        b.evaluate(x)
        np.testing.assert_allclose(a.evaluate([40 + step]), b.evaluate([40 + step]), rtol=0, atol=1e-8)
        for layer in range(a.cache.n_layer):
            assert torch.equal(a.cache.logical(layer), b.cache.logical(layer))
        assert a.cache.nbytes() == b.cache.nbytes()


@pytest.mark.parametrize("cfg", [
    KVCompressConfig(policy="none", bits=4, key_bits=8, group=16),
    KVCompressConfig(policy="none", bits=4, group=8, rot_block=8, hold="float16"),
], ids=_cfg_id)
def test_speculative_greedy_equals_plain_with_compressed_cache(stories260k: Path, cfg: KVCompressConfig) -> None:
    """Per-token quantization holds every token the same whatever the pass: speculative == plain, token for token.

    (Eviction and KIVI grouping act per pass, so a T-token verify pass sees up to T-1
    more full-precision or unevicted entries than token-by-token decoding; for those the
    guarantee is the rollback exactness tested above.)
    """
    from tandem.kernels.sampling import Sampler
    from tandem.kernels.sampling_params import SamplingParams
    from tandem.runtime.generate import generate
    from tandem.runtime.speculative.factory import SpecOptions, build_strategy

    outs = []
    for spec in (False, True):
        b = TorchBackend(stories260k, TorchConfig(device="cpu", dtype="float64", n_threads=1))
        use_compressed_cache(b, cfg)
        prompt = b.tokenize("Lily saw a big dog. The dog was happy. Lily saw a big dog. The dog", add_bos=True)
        opts = SpecOptions(mode="ngram", draft_length=4, measure_cost=False)
        strategy = build_strategy(b, None, opts) if spec else build_strategy(b, None, SpecOptions(mode="off"))
        sampler = Sampler(SamplingParams.greedy_params())
        *_, done = generate(b, prompt, sampler, strategy=strategy, max_tokens=64, stop_at_eog=False)
        outs.append(done)
        strategy.close()
    assert outs[0].tokens == outs[1].tokens
    st = outs[1].stats
    assert 0 < st.accepted_tokens < st.drafted_tokens  # drafts were accepted and rejected


def test_cake_cascade_keeps_total_under_budget_during_prefill(stories260k: Path) -> None:
    cfg = KVCompressConfig(policy="cake", sinks=4, window=8, budget=24)
    b = TorchBackend(stories260k, TorchConfig(device="cpu", n_threads=1, n_batch=512))
    cache = use_compressed_cache(b, cfg)
    totals: list[int] = []
    original = cache.observe_attention

    def spy(layer, probs):
        original(layer, probs)
        totals.append(sum(cache.stored(i) for i in range(cache.n_layer)))

    cache.observe_attention = spy  # type: ignore[method-assign]
    ids = b.tokenize(PROMPT * 6, add_bos=True)
    assert len(ids) > 4 * cfg.budget
    b.evaluate(ids)  # one long pass
    assert len(totals) == cache.n_layer
    assert max(totals) <= cfg.budget * cache.n_layer
    assert totals[0] == cfg.budget * cache.n_layer  # layer 0 alone may use the whole total
    for layer in range(cache.n_layer):
        assert cache.logical(layer)[:4].tolist() == [0, 1, 2, 3]
        assert set(range(len(ids) - cfg.window, len(ids))) <= set(cache.logical(layer).tolist())


def test_cake_cascade_with_room_for_everything_is_identity(stories260k: Path) -> None:
    ids_text = PROMPT * 3
    ref = _backend(stories260k, None)
    b = _backend(stories260k, KVCompressConfig(policy="cake", window=8, budget=4096))
    ids = ref.tokenize(ids_text, add_bos=True)
    np.testing.assert_allclose(b.evaluate(ids, logits_for=list(range(len(ids)))),
                               ref.evaluate(ids, logits_for=list(range(len(ids)))), atol=1e-4)
    assert b.cache.evicted == 0 and all(b.cache.stored(i) == len(ids) for i in range(b.cache.n_layer))


def test_kivi_groups_form_lazily_and_bytes_count_everything(stories260k: Path) -> None:
    cfg = KVCompressConfig(policy="none", sinks=4, bits=4, group=32, key_mode="channel", key_group=8, residual=3)
    b = _backend(stories260k, cfg)
    cache: CompressedKVCache = b.cache
    ids = b.tokenize(PROMPT, add_bos=True)
    b.evaluate(ids)
    body = cache._body[0]
    assert body.n_q == 0 and body.rk.shape[0] == len(ids) - 4  # nothing grouped inside the pass
    b.evaluate([9])
    n_body = len(ids) - 4
    groups = (n_body - 3) // 8
    assert body.n_q == 8 * groups and body.rk.shape[0] == n_body + 1 - 8 * groups
    w, layers = cache.width, cache.n_layer
    expect = layers * (2 * 4 * w * 4 + (n_body + 1) * (w // 2 + 4) + body.n_q * w // 2
                       + groups * (4 * w + 4) + body.rk.shape[0] * w * 4)
    assert cache.nbytes() == expect


def test_key_reordering_from_calibration(stories260k: Path) -> None:
    from tandem.kernels.hadamard import balanced_permutation
    from tandem.runtime.kv.segments import calibrate_key_scales

    b = _backend(stories260k, None)
    scales = calibrate_key_scales(b, b.tokenize("One day, a cat sat on a mat. It was warm.", add_bos=True))
    assert len(scales) == b.model_config.n_layer and len(b.tokens) == 0
    assert all(s.shape == (b.model_config.kv_width,) and (s > 0).all() for s in scales)
    cfg = KVCompressConfig(policy="none", bits=8, group=8, rot_block=8)
    cache = use_compressed_cache(b, cfg)
    perms = [balanced_permutation(s, 8) for s in scales]
    assert perms[0].tolist() != list(range(len(perms[0])))
    cache.set_key_order(perms)
    ref = _backend(stories260k, None)
    ids = b.tokenize(PROMPT, add_bos=True)
    b.evaluate(ids)
    ref.evaluate(ids)
    # Reading undoes the reordering: layer 0's keys (same inputs) match to 8-bit precision.
    k0, _, _ = cache._read(0, 0)
    ref_k = ref.cache._k[0][:, : len(ids)]
    assert float((k0 - ref_k).norm() / ref_k.norm()) < 0.01


def test_cake_budgets_and_window(stories260k: Path) -> None:
    cfg = KVCompressConfig(policy="cake", sinks=4, window=8, budget=20)
    b = _backend(stories260k, cfg)
    ids = b.tokenize(PROMPT, add_bos=True)
    b.evaluate(ids)
    for _ in range(12):
        b.evaluate([int(b.evaluate([5])[-1].argmax())])
        b.evaluate([9])  # next pass evicts
        stored = [b.cache.stored(i) for i in range(b.cache.n_layer)]
        assert sum(stored) - b.cache.n_layer <= cfg.budget * b.cache.n_layer
        n = len(b.tokens)
        for layer in range(b.cache.n_layer):
            logical = b.cache.logical(layer).tolist()
            assert set(range(n - cfg.window, n)) <= set(logical)  # the window is kept
            assert logical[:4] == [0, 1, 2, 3]


def test_cake_statistics_are_small_and_counted(stories260k: Path) -> None:
    """CAKE's attention statistics are O(kv heads x entries) and part of ``nbytes``."""
    cfg = KVCompressConfig(policy="cake", sinks=4, window=8, budget=20)
    b = _backend(stories260k, cfg)
    cache: CompressedKVCache = b.cache
    b.evaluate(b.tokenize(PROMPT * 2, add_bos=True))
    for t in range(10):
        b.evaluate([5 + t])
    stats = 0
    for layer in range(cache.n_layer):
        body, n = cache._body[layer], cache.stored(layer)
        # Folded up to the previous pass: the newest entry has no history yet.
        assert body.m1.shape == (cache.n_head_kv, n - 1) and body.m2.shape == (n - 1,)
        assert body.obs.shape == (cache.n_head_kv, 1, n)  # the last pass, held for rollback
        stats += 2 * (body.m1.numel() + body.m2.numel() + body.obs.numel())  # fp16
    kv = sum(2 * cache.stored(i) * cache.width * 4 for i in range(cache.n_layer))
    assert cache.nbytes() == kv + stats
    assert stats < kv


def test_cake_full_budget_matches_full_cache(stories260k: Path) -> None:
    ref_tokens, ref_logits = _greedy(_backend(stories260k, None), 20)
    tokens, logits = _greedy(_backend(stories260k, KVCompressConfig(policy="cake", window=8, budget=4096)), 20)
    assert tokens == ref_tokens
    np.testing.assert_allclose(logits, ref_logits, atol=1e-4)  # explicit softmax vs SDPA


def test_tree_accept_path_with_compressed_cache(stories260k: Path) -> None:
    cfg = KVCompressConfig(policy="window", sinks=4, window=8)
    a, b = _backend(stories260k, cfg), _backend(stories260k, cfg)
    ids = a.tokenize(PROMPT, add_bos=True)
    a.evaluate(ids)
    b.evaluate(ids)
    a.evaluate_tree([30, 31, 40, 41], [-1, 0, 0, 2])
    a.accept_path([0, 2, 3])
    b.evaluate([30, 40, 41])
    assert a.cache.logical(0).tolist() == b.cache.logical(0).tolist()
    assert torch.equal(a.cache.positions(0), b.cache.positions(0))
    # Batched vs sequential matmuls differ in the last bits, so not bit-exact.
    np.testing.assert_allclose(a.evaluate([50]), b.evaluate([50]), atol=1e-4)


def test_full_cache_keep_tree_path_off_node_zero() -> None:
    """keep() keeps the prefix before the last pass and compacts the chosen nodes after it.

    The accepted branch [n0+2, n0+5] does not start at the pass start n0: nodes n0 and
    n0+1 (another root's subtree) must go, not stay because they precede the branch.
    """
    c = KVCache(1, 1, 1, capacity=2)
    n0 = 5
    for start, n in ((0, n0), (n0, 6)):
        vals = torch.arange(start, start + n, dtype=torch.float32) + (100 if start else 0)
        c.update(0, vals.view(1, n, 1), vals.view(1, n, 1), torch.arange(start, start + n))
        c.commit(n)
    c.keep([n0 + 2, n0 + 5])
    assert len(c) == n0 + 2
    assert c._k[0][0, : len(c), 0].tolist() == [0, 1, 2, 3, 4, 107, 110]
    assert c.positions().tolist() == [0, 1, 2, 3, 4, 7, 10]
    c.update(0, torch.zeros(1, 3, 1), torch.zeros(1, 3, 1), torch.arange(7, 10))
    c.commit(3)
    c.keep([])  # no node accepted: back to the prefix
    assert len(c) == n0 + 2
    with pytest.raises(ValueError):
        c.keep([3])  # before the last pass


@pytest.mark.parametrize("cfg", [None, *CONFIGS], ids=_cfg_id)
def test_accept_path_off_node_zero_equals_plain_branch(stories260k: Path, cfg: KVCompressConfig | None) -> None:
    """Two roots; accepting the second root's branch equals evaluating that branch alone."""
    a, b = _backend(stories260k, cfg), _backend(stories260k, cfg)
    ids = a.tokenize(PROMPT, add_bos=True)
    for _ in range(2):  # the second round runs with evictions/quantized groups in place
        a.evaluate(ids[:8])
        b.evaluate(ids[:8])
    a.evaluate_tree([30, 31, 40, 41, 42], [-1, 0, -1, 2, 2])
    a.accept_path([2, 4])
    b.evaluate([40, 42])
    assert a.tokens == b.tokens and len(a.cache) == len(b.cache)
    if cfg is not None:
        for layer in range(a.cache.n_layer):
            assert a.cache.logical(layer).tolist() == b.cache.logical(layer).tolist()
            assert torch.equal(a.cache.positions(layer), b.cache.positions(layer))
    for t in (50, 51):
        np.testing.assert_allclose(a.evaluate([t]), b.evaluate([t]), atol=1e-4)


def test_bad_config_is_rejected() -> None:
    with pytest.raises(ValueError):
        KVCompressConfig(policy="lru")
    with pytest.raises(ValueError):
        KVCompressConfig(bits=3)
