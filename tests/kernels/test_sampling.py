"""Sampling kernels: each transformation does what it says, and draws follow `distribution`."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.kernels.sampling import (
    Sampler,
    apply_logit_bias,
    apply_presence_frequency,
    apply_repetition_penalty,
    min_p_filter,
    softmax,
    top_k_mask,
    top_p_filter,
)
from tandem.kernels.sampling_params import SamplingParams

RNG = np.random.default_rng(0)


def test_softmax_is_a_distribution_and_shift_invariant() -> None:
    x = RNG.normal(size=50) * 10
    p = softmax(x)
    assert p.min() >= 0 and abs(p.sum() - 1) < 1e-12
    np.testing.assert_allclose(p, softmax(x + 123.0), rtol=1e-10)


def test_top_k_keeps_exactly_the_k_largest() -> None:
    x = np.array([0.1, 5.0, -1.0, 3.0, 2.0])
    kept = np.isfinite(top_k_mask(x, 2))
    assert kept.tolist() == [False, True, False, True, False]
    assert np.array_equal(top_k_mask(x, 0), x)


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    p = np.array([0.5, 0.3, 0.15, 0.05])
    out = top_p_filter(p, 0.7)
    assert (out > 0).tolist() == [True, True, False, False]
    assert abs(out.sum() - 1) < 1e-12
    np.testing.assert_allclose(out[:2], [0.5 / 0.8, 0.3 / 0.8])


def test_top_p_matches_a_full_stable_sort_with_ties_and_zeros() -> None:
    """Sorting only the support gives what a stable sort of the whole vocabulary gives,
    ties (kept in id order) and zero-probability tokens (after top-k) included."""
    rng = np.random.default_rng(7)
    for _ in range(200):
        probs = rng.integers(0, 4, size=int(rng.integers(2, 60))).astype(float)
        if probs.sum() == 0:
            continue
        probs /= probs.sum()
        p = float(rng.uniform(0.05, 0.99))
        order = np.argsort(-probs, kind="stable")
        keep = order[: int(np.searchsorted(np.cumsum(probs[order]), p, side="left")) + 1]
        want = np.zeros_like(probs)
        want[keep] = probs[keep]
        np.testing.assert_allclose(top_p_filter(probs, p), want / want.sum())


def test_min_p_drops_tokens_below_fraction_of_max() -> None:
    p = np.array([0.6, 0.3, 0.05, 0.05])
    out = min_p_filter(p, 0.1)
    assert (out > 0).tolist() == [True, True, False, False]


def test_repetition_penalty_pushes_seen_tokens_down() -> None:
    x = np.array([2.0, -2.0, 1.0], dtype=np.float32)
    out = apply_repetition_penalty(x, [0, 1], 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0]
    assert x.tolist() == [2.0, -2.0, 1.0], "input must not be modified"


def test_presence_and_frequency_penalties_count_what_was_seen() -> None:
    x = np.array([2.0, -2.0, 1.0, 0.5], dtype=np.float32)
    out = apply_presence_frequency(x, [0, 1, 0, 0], presence=0.5, frequency=0.25)
    assert out.tolist() == [2.0 - 0.5 - 0.75, -2.0 - 0.5 - 0.25, 1.0, 0.5]
    assert x.tolist() == [2.0, -2.0, 1.0, 0.5], "input must not be modified"
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, presence_penalty=-1.0,
                               repeat_last_n=2))
    p = s.distribution(np.zeros(4, dtype=np.float32), [3, 1, 2])  # only the last 2 count: 1 and 2 raised by 1
    assert p[1] == pytest.approx(p[2]) and p[1] == pytest.approx(np.e * p[0]) and p[3] == pytest.approx(p[0])
    assert s.params.penalized and not SamplingParams().penalized


def test_logit_bias_adds_to_the_named_tokens_and_false_bans() -> None:
    x = np.array([2.0, -2.0, 1.0, 0.5], dtype=np.float32)
    out = apply_logit_bias(x, ((1, 5.0), (2, -np.inf), (1, 0.5), (7, 9.0)))  # 7: past this vocabulary
    assert out.tolist() == [2.0, 3.5, -np.inf, 0.5]
    assert x.tolist() == [2.0, -2.0, 1.0, 0.5], "input must not be modified"
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, logit_bias=((3, np.log(2.0)),
                                                                                         (0, -np.inf))))
    p = s.distribution(np.zeros(4, dtype=np.float32))
    assert p[0] == 0.0 and p[3] == pytest.approx(2 * p[1]) and p[1] == pytest.approx(p[2])
    greedy = Sampler(SamplingParams(temperature=0.0, logit_bias=((2, 1.5),)))
    assert greedy(x) == 2 and greedy.distribution(x)[2] == 1.0
    # a drafter in another vocabulary draws without it, from the same random stream
    plain = s.unbiased()
    assert plain.params.logit_bias == () and plain.rng is s.rng and greedy.unbiased().unbiased() is not greedy
    assert Sampler(SamplingParams()).unbiased().params == SamplingParams()


def test_greedy_sampler_is_argmax_and_distribution_is_one_hot() -> None:
    x = RNG.normal(size=30)
    s = Sampler(SamplingParams.greedy_params())
    assert s(x) == int(np.argmax(x))
    d = s.distribution(x)
    assert d[int(np.argmax(x))] == 1.0 and d.sum() == 1.0


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, seed=2),
        SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=3, logit_bias=((4, 3.0), (5, -np.inf))),
    ],
)
def test_draws_follow_the_reported_distribution(params: SamplingParams) -> None:
    logits = np.random.default_rng(3).normal(size=12) * 2
    s = Sampler(params)
    p = s.distribution(logits)
    n = 40_000
    counts = np.bincount([s(logits) for _ in range(n)], minlength=12)
    tv = 0.5 * np.abs(counts / n - p).sum()
    assert tv < 0.015, f"total variation {tv:.4f}"
    assert counts[p == 0].sum() == 0, "a token with zero probability was drawn"


def test_seed_makes_sampling_reproducible() -> None:
    logits = RNG.normal(size=40)
    a = Sampler(SamplingParams(temperature=1.0, seed=7))
    b = Sampler(SamplingParams(temperature=1.0, seed=7))
    assert [a(logits) for _ in range(50)] == [b(logits) for _ in range(50)]
