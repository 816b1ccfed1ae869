"""Pure KV kernels: Hadamard rotation, low-bit quantization, sink/window and CAKE budgets."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.kernels.hadamard import (
    balanced_permutation,
    fwht,
    hadamard_matrix,
    pow2_block,
    rotation_matrix,
)
from tandem.kernels.kv_budget import (
    allocate_budgets,
    eviction_scores,
    fold_moments,
    layer_preference,
    preference_from_moments,
    scores_from_moments,
    select_keep,
    sinks_window_keep,
)
from tandem.kernels.kv_quant import (
    bytes_per_row,
    dequantize,
    dequantize_channels,
    max_error_bound,
    pack,
    quantize,
    quantize_channels,
    unpack,
)


@pytest.mark.parametrize("n", [1, 2, 8, 16, 64, 128, 24, 96])
def test_hadamard_is_orthonormal(n: int) -> None:
    h = hadamard_matrix(n)
    assert torch.allclose(h @ h.T, torch.eye(n, dtype=h.dtype), atol=1e-12)
    # Self-inverse: applying the transform twice gives the input back.
    x = torch.randn(3, 5, n, dtype=torch.float64)
    assert torch.allclose(fwht(fwht(x)), x, atol=1e-12)


def test_hadamard_entries_are_plus_minus_one_over_sqrt_block() -> None:
    h = hadamard_matrix(16)
    assert torch.allclose(h.abs(), torch.full((16, 16), 0.25, dtype=h.dtype))
    # Sylvester construction, computed independently.
    s = torch.tensor([[1.0]], dtype=torch.float64)
    for _ in range(4):
        s = torch.cat((torch.cat((s, s), 1), torch.cat((s, -s), 1)), 0)
    assert torch.allclose(h, s / 4)


def test_rotation_preserves_dot_products_fp32() -> None:
    torch.manual_seed(0)
    q = torch.randn(8, 64)
    k = torch.randn(8, 64)
    k[:, 3] *= 40  # an outlier channel
    assert torch.allclose((fwht(q) * fwht(k)).sum(-1), (q * k).sum(-1), atol=1e-5, rtol=1e-5)


def test_rotation_spreads_outliers() -> None:
    x = torch.zeros(64)
    x[5] = 10.0
    y = fwht(x)
    assert y.abs().max() < 2.0 and torch.isclose(y.norm(), x.norm())


def test_pow2_block_and_bad_block() -> None:
    assert pow2_block(96) == 32 and pow2_block(64) == 64 and pow2_block(7) == 1
    with pytest.raises(ValueError):
        fwht(torch.zeros(12), block=8)


def test_balanced_permutation_deals_outliers_to_different_blocks() -> None:
    scale = torch.ones(16)
    scale[[0, 1, 2, 3]] = torch.tensor([50.0, 40.0, 30.0, 20.0])
    perm = balanced_permutation(scale, block=4)
    assert sorted(perm.tolist()) == list(range(16))
    blocks = perm.reshape(4, 4)
    for b in range(4):
        assert sum(int(c) in (0, 1, 2, 3) for c in blocks[b]) == 1


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_round_trip(bits: int) -> None:
    codes = torch.randint(0, 1 << bits, (3, 7, 32), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.shape[-1] == 32 * bits // 8
    assert torch.equal(unpack(packed, bits), codes)


@pytest.mark.parametrize("bits,group", [(4, 16), (4, 64), (2, 16), (2, 32), (8, 8)])
def test_quantize_round_trip_error_is_bounded(bits: int, group: int) -> None:
    torch.manual_seed(bits * 100 + group)
    x = torch.randn(5, 6, 64) * 3 + 1
    q = quantize(x, bits, group)
    y = dequantize(q)
    err = (x - y).abs().reshape(5, 6, 64 // group, group).amax(-1)
    assert (err <= max_error_bound(x, bits, group)).all()
    assert q.nbytes == 5 * 6 * bytes_per_row(64, bits, group)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=16, max_size=16), min_size=1, max_size=4),
    bits=st.sampled_from([2, 4]),
)
def test_quantize_error_bound_property(rows: list[list[float]], bits: int) -> None:
    x = torch.tensor(rows)
    err = (x - dequantize(quantize(x, bits, 8))).abs().reshape(len(rows), 2, 8).amax(-1)
    assert (err <= max_error_bound(x, bits, 8)).all()


def test_constant_rows_are_exact() -> None:
    x = torch.full((2, 32), 0.375)
    assert torch.equal(dequantize(quantize(x, 2, 16)), x)


def test_quantize_rejects_bad_groups() -> None:
    with pytest.raises(ValueError):
        quantize(torch.zeros(2, 30), 4, 16)
    with pytest.raises(ValueError):
        quantize(torch.zeros(2, 32), 3, 16)


def test_sinks_window_keep() -> None:
    assert sinks_window_keep(5, 4, 8).tolist() == list(range(5))
    keep = sinks_window_keep(100, 4, 8)
    assert keep.tolist() == [0, 1, 2, 3, *range(92, 100)]


@settings(max_examples=60, deadline=None)
@given(
    prefs=st.lists(st.floats(0, 10, allow_nan=False), min_size=1, max_size=8),
    data=st.data(),
)
def test_allocate_budgets_sum_and_caps(prefs: list[float], data: st.DataObject) -> None:
    lengths = data.draw(st.lists(st.integers(0, 200), min_size=len(prefs), max_size=len(prefs)))
    total = data.draw(st.integers(0, 1000))
    budgets = allocate_budgets(prefs, total, lengths)
    assert sum(budgets) == min(total, sum(lengths))
    assert all(0 <= b <= n for b, n in zip(budgets, lengths, strict=True))


def test_allocate_budgets_full_is_identity_and_proportional() -> None:
    assert allocate_budgets([1.0, 5.0, 0.1], 300, [100, 100, 100]) == [100, 100, 100]
    # Layer 1 is capped at its length; its excess goes to the others by preference.
    assert allocate_budgets([1.0, 8.0, 1.0], 100, [100, 20, 100]) == [40, 20, 40]
    assert allocate_budgets([1.0, 3.0], 40, [100, 100]) == [10, 30]


def _attn(heads: int, w: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(heads, w, n, generator=g) * 2, dim=-1)


def test_layer_preference_grows_with_dispersion_and_shift() -> None:
    peaked = torch.zeros(2, 4, 10)
    peaked[..., 0] = 1.0
    peaked[..., 0, 0] = 0.9
    peaked[..., 0, 1] = 0.1
    spread = _attn(2, 4, 10, 0)
    assert layer_preference(spread) > layer_preference(peaked) > 0


def test_eviction_scores_and_select_keep_retain_window_and_sinks() -> None:
    attn = _attn(4, 8, 50, 1)
    scores = eviction_scores(attn)
    assert scores.shape == (50,)
    keep = select_keep(scores, budget=20, window=8, sinks=2)
    assert len(keep) == 20 and keep.tolist() == sorted(keep.tolist())
    assert {0, 1, *range(42, 50)} <= set(keep.tolist())
    free = [i for i in range(2, 42)]
    chosen = [i for i in keep.tolist() if i in free]
    rest = [i for i in free if i not in chosen]
    assert min(scores[chosen]) >= max(scores[rest])
    assert select_keep(scores, budget=50, window=8).tolist() == list(range(50))
    # Budget below sinks + window: sinks then the most recent tokens.
    assert select_keep(scores, budget=5, window=8, sinks=2).tolist() == [0, 1, 47, 48, 49]


def test_reordered_rotation_is_orthonormal_and_invertible_fp32() -> None:
    """RotateKV: permute (calibrated) then blockwise Hadamard; inverse exact, q.k kept to 1e-5."""
    torch.manual_seed(3)
    calib = torch.randn(200, 32)
    calib[:, [1, 2, 3]] *= 30  # three outlier channels in the first Hadamard block
    perm = balanced_permutation(calib.abs().amax(0), block=8)
    assert sorted(perm.tolist()) == list(range(32))
    inv = torch.argsort(perm)
    x = torch.randn(5, 32)
    assert torch.equal(x[:, perm][:, inv], x)  # inverse restores exactly
    assert all(sum(int(c) in (1, 2, 3) for c in blk) <= 1 for blk in perm.reshape(4, 8))
    m = rotation_matrix(32, 8, perm)
    assert torch.allclose(m @ m.T, torch.eye(32), atol=1e-6)
    assert torch.allclose(x @ m, fwht(x[:, perm], 8), atol=1e-6)
    q, k = torch.randn(16, 32), calib[:16]
    assert torch.allclose(((q @ m) * (k @ m)).sum(-1), (q * k).sum(-1), rtol=1e-5, atol=1e-5 * float(k.abs().max()))
    assert torch.allclose((k @ m) @ m.T, k, atol=1e-5 * float(k.abs().max()))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_channel_quantization_bound_and_outlier_channels(bits: int) -> None:
    torch.manual_seed(bits)
    x = torch.randn(64, 32)
    x[:, 5] = x[:, 5] * 20 + 40  # an outlier channel, as keys have
    packed, step, lo = quantize_channels(x, bits)
    assert packed.shape == (64, 32 * bits // 8) and step.shape == lo.shape == (32,)
    y = dequantize_channels(packed, bits, step, lo)
    bound = max_error_bound(x.T.contiguous(), bits, 64).squeeze(-1)  # per channel over the tokens
    assert ((x - y).abs().amax(0) <= bound).all()
    # Per channel, the outlier no longer sets the step of the other channels.
    per_token = (x - dequantize(quantize(x, bits, 32))).norm()
    assert (x - y).norm() < per_token
    # Dropping tokens keeps the others' codes and the group's parameters valid.
    keep = torch.tensor([0, 7, 63])
    assert torch.equal(dequantize_channels(packed[keep], bits, step, lo), y[keep])


def test_running_moments_equal_window_statistics_then_decay() -> None:
    attn = _attn(3, 12, 20, 4)
    m1, m2, seen = fold_moments(None, None, 0, attn[:, :5], window=16)  # in two passes,
    m1, m2, seen = fold_moments(m1, m2, seen, attn[:, 5:], window=16)  # as decoding does
    assert seen == 12
    assert torch.allclose(scores_from_moments(m1, m2), eviction_scores(attn), atol=1e-6)
    assert abs(preference_from_moments(m1, m2) - layer_preference(attn)) < 1e-5 * layer_preference(attn)
    # New keys join with zero history; past the window, old rows fade with weight 1 - 1/window.
    more = _attn(3, 40, 24, 5)
    m1, m2, seen = fold_moments(m1, m2, seen, more, window=16)
    assert m1.shape == (3, 24) and m2.shape == (24,)
    assert torch.allclose(m1.sum(-1), torch.ones(3), atol=1e-5)  # still a distribution per head
