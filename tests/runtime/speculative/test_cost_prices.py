"""The verify prices the adaptive policy reads every round, made once per observation,
equal their per-size definition, and what is priced from them moves when they move."""

from __future__ import annotations

import statistics
from collections import deque

import numpy as np
import pytest

from tandem.kernels.acceptance import expected_tokens_upto
from tandem.runtime.speculative.cost import CostCurve, OnlineCost
from tandem.runtime.speculative.policy.adaptive import AdaptivePolicy, best_index
from tandem.runtime.speculative.policy.adaptive_config import AdaptiveConfig


def reference_call(cost: OnlineCost, seen: dict[int, deque], k: int) -> float:
    """c(k) as :class:`OnlineCost` defines it, size by size: a size called at least twice
    costs the median of its recent calls over t1; the others the prior, its excess over
    one step scaled by the median ratio of the learnt sizes' excess to the prior's; never
    above k + 1."""
    if k == 0:
        return 1.0
    t1 = cost.t1_s
    learnt = {j: max(1.0, statistics.median(times) / t1) for j, times in seen.items() if j > 0 and len(times) >= 2}
    if k in learnt:
        return min(learnt[k], k + 1.0)
    scales = [(x - 1.0) / (cost.prior(j) - 1.0) for j, x in learnt.items() if cost.prior(j) > 1.0]
    scale = statistics.median(scales) if scales else 1.0
    return min(1.0 + (cost.prior(k) - 1.0) * scale, k + 1.0)


@pytest.mark.parametrize("seed", range(4))
def test_every_price_equals_its_definition_after_each_observation(seed: int) -> None:
    """Observations of random sizes at random times (a first-run cost timing its first
    sizes, so the prior itself is replaced midway): after each, every size's price is the
    definition's, to the last bit, beyond the learnt sizes too."""
    rng = np.random.default_rng(seed)
    cost = OnlineCost.untimed(8, chunk=7)
    seen: dict[int, deque] = {}
    for _ in range(120):
        k = int(rng.choice([0, 0, 0, 1, 2, 3, 5, 6, int(rng.integers(0, 33))]))
        seconds = float(rng.uniform(0.01, 0.01 * (k + 1.5)))
        cost.observe(k, seconds)
        seen.setdefault(k, deque(maxlen=cost.window)).append(seconds)
        for j in range(40):
            assert cost.call(j) == reference_call(cost, seen, j), (j, dict(seen))
        assert cost.calls_upto(40) == [cost.call(j) for j in range(41)]
    assert cost.timed


def test_what_never_wrong_drafts_could_reach_follows_the_costs() -> None:
    """A policy that found drafts able to pay on a cheap verify stops verifying them once
    its calls are timed at k + 1 steps (a compute-bound target), and sees them pay again
    when the prices are given anew."""
    cheap = CostCurve.linear(0.1)
    policy = AdaptivePolicy(OnlineCost(cheap, measure_t1=False), AdaptiveConfig(max_len=8), cheap_drafter=True)
    sure = [0.99] * 8
    assert policy.free_ceiling() > 2 and policy.probe_can_pay()
    for _ in range(3):
        for k in range(0, 33):
            policy.observe(0, 0, 0.0, 0.01 * (k + 1), 0.01 * (k + 1), evaluated=k + 1)
    assert policy.free_ceiling() == pytest.approx(1.0) and not policy.probe_can_pay()
    assert policy.trim(sure, 8, "suffix") == 0
    policy.cost = OnlineCost(cheap, measure_t1=False)  # the same version count, another cost
    assert policy.free_ceiling() > 2


def test_the_best_length_is_the_first_of_the_highest_rates() -> None:
    rng = np.random.default_rng(3)
    for _ in range(200):
        rates = rng.integers(0, 4, size=int(rng.integers(1, 12))).astype(float).tolist()
        assert best_index(rates) == int(np.argmax(rates))


def test_expected_tokens_of_every_length_is_the_running_sum_of_reach() -> None:
    a = np.random.default_rng(5).uniform(0.0, 1.0, 10)
    got = expected_tokens_upto(a, 14)
    want = np.concatenate([[1.0], 1.0 + np.cumsum(np.cumprod(a))])
    assert got[:11] == pytest.approx(want.tolist(), rel=1e-12)
    assert got[11:] == [got[10]] * 4  # positions past the rates add nothing
