"""The acceptance kernel is exactly lossless: statistical checks against known p.

Single-step checks run the batched kernel (``speculative_step``: the same ratio,
residual and inverse-CDF functions ``verify_sampled`` uses) over 10^6 trials; the
sequence-level checks run the full speculative strategy on toy Markov models and
compare the empirical joint of whole sequences with the exact target joint.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from toy_models import (
    PURE,
    ToyBackend,
    check_matches,
    exact_joint,
    model_distribution,
    random_table,
)

from tandem.kernels.acceptance import (
    acceptance_ratio,
    inverse_cdf,
    residual,
    speculative_step,
    verify_greedy,
    verify_sampled,
)
from tandem.kernels.sampling import Sampler
from tandem.runtime.generate import generate
from tandem.runtime.speculative.drafters.base import Draft
from tandem.runtime.speculative.drafters.model import ModelDrafter
from tandem.runtime.speculative.loop import speculative
from tandem.runtime.speculative.policy.base import FixedLength

N = 1_000_000


def run_step(p: np.ndarray, q: np.ndarray | None, seed: int, x_fixed: int | None = None):
    """10^6 independent single-position trials: x ~ q (or fixed), accept/reject."""
    rng = np.random.default_rng(seed)
    v8 = len(p)
    P = np.broadcast_to(p, (N, v8))
    if q is None:
        x = np.full(N, x_fixed)
        Q = None
    else:
        Q = np.broadcast_to(q, (N, v8))
        x = inverse_cdf(Q, rng.random(N))
    accepted, token = speculative_step(P, Q, x, rng.random(N), rng.random(N))
    return accepted, np.bincount(token, minlength=v8)


def rand_dist(rng: np.random.Generator, n: int = 8) -> np.ndarray:
    return rng.dirichlet(np.ones(n))


@pytest.mark.parametrize("seed", [0, 1])
def test_single_step_random_p_q(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    p, q = rand_dist(rng), rand_dist(rng)
    accepted, counts = run_step(p, q, seed)
    check_matches(counts, p, tv_bound=3e-3)
    alpha = np.minimum(p, q).sum()  # theory: acceptance rate = sum min(p, q)
    assert abs(accepted.mean() - alpha) < 4 * math.sqrt(alpha * (1 - alpha) / N)


def test_q_zero_where_p_is_not() -> None:
    rng = np.random.default_rng(7)
    p = rand_dist(rng)
    q = rand_dist(rng)
    q[[1, 4, 6]] = 0.0
    q /= q.sum()
    accepted, counts = run_step(p, q, 3)
    check_matches(counts, p, tv_bound=3e-3)
    assert counts[[1, 4, 6]].sum() > 0  # reachable only through the residual


def test_p_equals_q_accepts_everything() -> None:
    p = rand_dist(np.random.default_rng(8))
    accepted, counts = run_step(p, p.copy(), 4)
    assert accepted.all()
    check_matches(counts, p, tv_bound=3e-3)


def test_one_hot_p() -> None:
    p = np.zeros(8)
    p[5] = 1.0
    q = rand_dist(np.random.default_rng(9))
    accepted, counts = run_step(p, q, 5)
    assert counts[5] == N
    assert abs(accepted.mean() - q[5]) < 5e-3


@pytest.mark.parametrize("x_fixed", [2, 6])
def test_deterministic_proposal(x_fixed: int) -> None:
    """q = None (model-free drafters): one-hot proposal, accepted with probability p(x)."""
    p = rand_dist(np.random.default_rng(10))
    accepted, counts = run_step(p, None, 6, x_fixed=x_fixed)
    check_matches(counts, p, tv_bound=3e-3)
    assert abs(accepted.mean() - p[x_fixed]) < 5e-3


def test_residual_never_nan_and_normalizable() -> None:
    p = np.array([[0.5, 0.5, 0.0]])
    assert np.allclose(residual(p, p.copy(), np.array([0])), p)  # p == q falls back to p
    one_hot = np.array([[0.0, 1.0, 0.0]])
    assert np.allclose(residual(one_hot, None, np.array([1])), one_hot)
    r = residual(np.array([[0.2, 0.3, 0.5]]), np.array([[0.5, 0.5, 0.0]]), np.array([0]))
    assert np.allclose(r, [[0.0, 0.0, 0.5]])
    assert not np.isnan(r).any()


def test_acceptance_ratio_edges() -> None:
    assert acceptance_ratio(np.array([0.3]), np.array([0.0]))[0] == 1.0
    assert acceptance_ratio(np.array([0.0]), np.array([0.0]))[0] == 0.0
    assert acceptance_ratio(np.array([0.3]), None)[0] == pytest.approx(0.3)
    assert acceptance_ratio(np.array([0.9]), np.array([0.3]))[0] == 1.0


def test_inverse_cdf_never_lands_on_zero() -> None:
    probs = np.array([[0.0, 0.5, 0.5, 0.0]] * 3)
    assert set(inverse_cdf(probs, np.array([0.0, 0.999999999999, 0.5])).tolist()) <= {1, 2}


def test_verify_greedy() -> None:
    assert verify_greedy([1, 2, 3], [1, 2, 3, 4]) == (v := verify_greedy([1, 2, 3], [1, 2, 3, 4]))
    assert (v.accepted, v.token) == (3, 4)
    v = verify_greedy([1, 5, 3], [1, 2])
    assert (v.accepted, v.token) == (1, 2)
    v = verify_greedy([], [7])
    assert (v.accepted, v.token) == (0, 7)


def test_verify_sampled_shapes_and_bounds() -> None:
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(5), size=4)
    q = rng.dirichlet(np.ones(5), size=3)
    for _ in range(200):
        v = verify_sampled([0, 1, 2], p, q, rng)
        assert 0 <= v.accepted <= 3 and 0 <= v.token < 5
    with pytest.raises(ValueError):
        verify_sampled([0, 1, 2], p[:3], q, rng)


# -- sequence level: the whole strategy on toy Markov models ------------------------------


class FixedProposer:
    """Deterministic drafter: always proposes the same tokens (q one-hot)."""

    name = "fixed"
    calls = 0
    stop_threshold = None

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def propose(self, context, max_tokens, sampler) -> Draft:
        return Draft(self.tokens[:max_tokens], None, self.name)

    def commit(self, context, n_accepted) -> None:
        pass

    def backlog(self, context) -> int:
        return 0

    def close(self) -> None:
        pass


def sample_sequences(target: ToyBackend, drafter, k: int, length: int, trials: int, seed: int) -> dict:
    strategy = speculative(drafter, FixedLength(k))
    sampler = Sampler(PURE)
    sampler.rng = np.random.default_rng(seed)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(trials):
        *_, done = generate(target, [0], sampler, strategy=strategy, max_tokens=length, stop_at_eog=False)
        key = tuple(done.tokens)
        counts[key] = counts.get(key, 0) + 1
    return counts


def check_joint(counts: dict, table: np.ndarray, length: int) -> None:
    joint = exact_joint(table, 0, length)
    keys = sorted(set(joint) | set(counts))
    observed = np.array([counts.get(k, 0) for k in keys], dtype=float)
    expected = np.array([joint.get(k, 0.0) for k in keys])
    # Noise-aware bound: 2x the expected TV of an exact sampler with this many trials.
    n = observed.sum()
    noise_tv = 0.5 * np.sum(np.sqrt(2 / np.pi * expected * (1 - expected) / n))
    check_matches(observed, expected, tv_bound=2 * noise_tv)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_sequence_joint_model_drafter(k: int) -> None:
    rng = np.random.default_rng(20 + k)
    target = ToyBackend(random_table(3, rng, zeros=0.2), "target")
    draft = ToyBackend(random_table(3, rng, zeros=0.3), "draft")
    counts = sample_sequences(target, ModelDrafter(draft), k, length=4, trials=3000, seed=k)
    check_joint(counts, model_distribution(target), 4)


def test_sequence_joint_deterministic_drafter() -> None:
    rng = np.random.default_rng(31)
    target = ToyBackend(random_table(3, rng), "target")
    counts = sample_sequences(target, FixedProposer([1, 1, 2]), 3, length=3, trials=3000, seed=5)
    check_joint(counts, model_distribution(target), 3)


def test_sequence_joint_identical_models_accept_all() -> None:
    rng = np.random.default_rng(41)
    table = random_table(3, rng)
    target, draft = ToyBackend(table, "target"), ToyBackend(table.copy(), "draft")
    strategy = speculative(ModelDrafter(draft), FixedLength(3))
    sampler = Sampler(PURE)
    *_, done = generate(target, [0], sampler, strategy=strategy, max_tokens=64, stop_at_eog=False)
    assert done.stats.accepted_tokens == done.stats.drafted_tokens > 0
    assert done.stats.target_calls <= math.ceil(64 / 4) + 1
