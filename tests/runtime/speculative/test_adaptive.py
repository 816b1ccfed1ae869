"""Adaptive speculation: the c(k) cache and the length policy (synthetic inputs, no timing
assertions)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from toy_models import ToyBackend, random_table

from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_config import LlamaConfig
from tandem.runtime.speculative.cost import (
    FIRST_SIZES,
    SAVED_RUNS,
    T1_CALLS_TO_SAVE,
    CostCurve,
    OnlineCost,
    curve_from_times,
    measure_cost_curve,
    merge_runs,
    one_token_step_s,
)
from tandem.runtime.speculative.cost_cache import load_cost_curve
from tandem.runtime.speculative.policy.adaptive import AdaptivePolicy
from tandem.runtime.speculative.policy.adaptive_config import PROBE_WORTHY, AdaptiveConfig
from tandem.runtime.speculative.policy.base import FixedLength
from tandem.runtime.speculative.policy.beliefs import UNPROVEN_FIRST

CPU = CostCurve((1.0, 1.7, 1.9, 2.1, 2.4, 2.55, 2.7, 2.85, 3.0), 0.1)


def feed(policy: AdaptivePolicy, accept_prob: float, rounds: int, seed: int = 0) -> list[int]:
    """Simulate rounds where each drafted token is accepted with ``accept_prob``."""
    rng = np.random.default_rng(seed)
    lengths = []
    for _ in range(rounds):
        k = policy.next_length()
        lengths.append(k)
        if k == 0:
            continue
        accepted = 0
        while accepted < k and rng.random() < accept_prob:
            accepted += 1
        policy.observe(k, accepted, draft_s=0.0, verify_s=policy.cost(k) * 0.1, round_s=policy.cost(k) * 0.1)
    return lengths


def test_policy_turns_off_at_zero_acceptance_and_probes() -> None:
    policy = AdaptivePolicy(CPU, AdaptiveConfig(max_len=8, probe_every=8, probe_max=64))
    lengths = feed(policy, 0.0, 400)
    tail = lengths[100:]
    assert sum(k > 0 for k in tail) <= 10  # probes only, with back-off
    assert any(k > 0 for k in tail)  # ... but it does probe again
    assert policy.best_length() == 0


def test_policy_speculates_when_acceptance_is_high() -> None:
    policy = AdaptivePolicy(CPU, AdaptiveConfig(max_len=8))
    lengths = feed(policy, 0.97, 300)
    assert np.median(lengths[50:]) >= 4
    assert policy.predicted_speedup(policy.best_length()) > 1.5


def test_policy_length_grows_with_acceptance_and_shrinks_with_cost() -> None:
    def settle(curve: CostCurve, p: float) -> int:
        policy = AdaptivePolicy(curve, AdaptiveConfig(max_len=8))
        feed(policy, p, 300)
        return policy.best_length()

    assert settle(CPU, 0.7) <= settle(CPU, 0.95)
    gpu = CostCurve.linear(0.02)
    assert settle(gpu, 0.7) >= settle(CPU, 0.7)
    assert settle(CostCurve.linear(1.0), 0.9) == 0  # verify as dear as decoding: never pays


def test_drafter_cost_counts() -> None:
    cheap = AdaptivePolicy(CostCurve.linear(0.05), AdaptiveConfig(max_len=8))
    dear = AdaptivePolicy(CostCurve.linear(0.05), AdaptiveConfig(max_len=8), draft_cost=0.5)
    for p in (cheap, dear):
        p.reached[:] = 100
        p.accepted[:] = 80
    assert dear.best_length() < cheap.best_length()


def test_expected_tokens_formula() -> None:
    policy = AdaptivePolicy(CPU, AdaptiveConfig(max_len=4, prior_weight=1e-9))
    policy.reached[:] = 1000
    policy.accepted[:] = 500
    alpha = 0.5
    for k in range(5):  # geometric case: (1 - a^(k+1)) / (1 - a)
        assert abs(policy.expected_tokens(k) - (1 - alpha ** (k + 1)) / (1 - alpha)) < 1e-6


def test_cost_curve_measured_once_and_cached(stories260k: Path, monkeypatch) -> None:
    with LlamaCppBackend(stories260k, LlamaConfig(n_ctx=256, n_threads=1)) as backend:
        backend.evaluate([1, 2, 3])
        curve = load_cost_curve(backend, k_max=4)
        assert backend.tokens == [1, 2, 3]  # the measurement left the cache as it was
        assert curve.c[0] == 1.0 and len(curve.c) == 5
        assert all(b >= a for a, b in zip(curve.c, curve.c[1:], strict=False))

        import tandem.runtime.speculative.cost_cache as adaptive

        def fail(*a, **k):
            raise AssertionError("measured again")

        monkeypatch.setattr(adaptive, "measure_cost_curve", fail)
        assert load_cost_curve(backend, k_max=4) == curve
    from tandem.models.paths import cache_dir

    table = json.loads((cache_dir() / "verify_cost.json").read_text())
    assert len(table) == 1 and next(iter(table.values()))["c"] == list(curve.c)


def test_measure_on_toy_backend_restores_cache() -> None:
    toy = ToyBackend(random_table(5, np.random.default_rng(0)))
    toy.evaluate([1, 2])
    curve = measure_cost_curve(toy, k_max=3, reps=1, context=8)
    assert toy.tokens == [1, 2] and len(curve.c) == 4


def test_curve_through_timed_sizes_interpolates_extends_and_never_falls() -> None:
    curve = curve_from_times({0: 0.040, 1: 0.080, 3: 0.160, 6: 0.150}, k_max=8)
    assert curve.c[:4] == pytest.approx((1.0, 2.0, 3.0, 4.0))
    assert curve.c[6] == curve.c[3] == pytest.approx(4.0)  # a faster longer call cannot make it cheaper
    assert list(curve.c) == sorted(curve.c) and curve.t1_s == 0.040
    steady = curve_from_times({0: 0.01, 3: 0.02, 6: 0.03}, k_max=8)
    assert steady.c[8] == pytest.approx(1.0 + 8 / 3)  # the last slope, extended


def test_an_untimed_target_asks_for_each_first_size_once_after_t1() -> None:
    """No curve cached: two plain rounds measure t1, then one call of each first size
    (padded drafts), and only then is the prior the curve through those calls."""
    cost = OnlineCost.untimed(8, chunk=7)
    policy = AdaptivePolicy(cost, AdaptiveConfig(max_len=8), cheap_drafter=True)
    asked = []
    for _ in range(2 + len(FIRST_SIZES)):
        k = policy.next_length()
        asked.append((k, policy.timing_length()))
        policy.observe(0, 0, 0.0, 0.010 * (k + 1), 0.010 * (k + 1), evaluated=k + 1)
        assert not cost.learnt or cost.timed
    assert asked == [(0, 0), (0, 0), *((k, k) for k in FIRST_SIZES)]
    assert cost.timed and cost.learnt
    assert cost.prior.c[:7] == pytest.approx(tuple(range(1, 8)))  # k + 1 tokens took k + 1 steps
    assert policy.next_length() > 0 and policy.timing_length() == 0


def test_untimed_sizes_stay_within_the_exact_chunk() -> None:
    """Each first size is capped at the longest exact call, so a short chunk (a repacked
    target's 3 tokens) still times its longest call."""
    assert FIRST_SIZES == (6, 3, 1)  # largest first (see FIRST_SIZES)
    assert OnlineCost.untimed(8, chunk=8).first_sizes == (6, 3, 1)
    assert OnlineCost.untimed(8, chunk=4).first_sizes == (3, 1)
    assert OnlineCost.untimed(8, chunk=3).first_sizes == (2, 1)
    assert OnlineCost.untimed(2).first_sizes == (2, 1)
    assert OnlineCost.untimed(8, chunk=1).first_sizes == ()


STEEP = CostCurve.linear(0.9)
"""A compute-bound target (a 1.5B Q4_K_M on one Zen 5 core measured 1 + 0.8-0.9 k)."""


def test_a_drafter_that_cannot_pay_at_any_acceptance_is_never_probed() -> None:
    """Next to a compute-bound target a drafter costing a third of it loses even when
    every draft is right, so probing it would only pay its catch-up: it is never asked.
    The same drafter next to a memory-bound target (flat curve) is still probed."""
    steep = AdaptivePolicy(STEEP, AdaptiveConfig(max_len=8, probe_every=4), draft_cost=0.35)
    assert steep.ceiling() < steep.config.min_gain
    assert feed(steep, 0.0, 300) == [0] * 300 and steep.probes == 0
    flat = AdaptivePolicy(CostCurve.linear(0.1), AdaptiveConfig(max_len=8, probe_every=4), draft_cost=0.35)
    assert flat.ceiling() > flat.config.min_gain
    assert any(k > 0 for k in feed(flat, 0.0, 300)) and flat.probes > 0


def test_a_free_drafter_next_to_a_steep_target_still_drafts_certain_runs() -> None:
    """Model-free drafts cost nothing to make: a long run it is sure of (copying text)
    pays even on a steep curve (2 cores: 1 + 0.6 k), a doubtful one does not. Where even
    a sure run gains under 10 % (one core, 1 + 0.9 k: at most 7 %) the source is not
    probed at all: a failed probe would cost more than trust could win back."""
    steep = CostCurve.linear(0.6)
    policy = AdaptivePolicy(steep, AdaptiveConfig(max_len=8, free_max_len=32), cheap_drafter=True)
    for _ in range(2):  # trust earned with short prefixes first
        n = policy.trim([0.999] * 24, 24, "suffix")
        assert n == 2
        policy.observe(n, n, 0.0, 0.1 * steep(n), 0.1 * steep(n), source="suffix")
    assert policy.trim([0.999] * 24, 24, "suffix") > 2
    assert policy.trim([0.5] * 24, 24, "suffix") == 0
    steepest = AdaptivePolicy(STEEP, AdaptiveConfig(max_len=8, free_max_len=32), cheap_drafter=True)
    assert max(steepest.rates(np.full(24, 0.999), 0.0, 24)) < steepest.config.probe_promise
    assert steepest.trim([0.999] * 24, 24, "suffix") == 0


def test_trim_gates_cheap_drafts_by_confidence_and_calibrates() -> None:
    policy = AdaptivePolicy(CPU, AdaptiveConfig(max_len=8, probe_every=1000), cheap_drafter=True)
    assert policy.next_length() == policy.config.free_max_len  # asking a model-free drafter is free
    assert policy.trim([0.99] * 6, 6) == 2  # an unproven source: a short prefix first
    policy.observe(2, 2, 0.0, 0.1 * CPU(2), 0.1 * CPU(2))
    assert policy.trim([0.99] * 6, 6) == 2
    policy.observe(2, 2, 0.0, 0.1 * CPU(2), 0.1 * CPU(2))
    assert policy.trim([0.99] * 6, 6) >= 3  # trust earned: a confident long match is worth verifying
    assert policy.trim([0.2, 0.2], 2) == 0  # a weak one is not: plain round
    # Confident drafts that keep failing: calibration drops and gating follows.
    for _ in range(60):
        n = policy.trim([0.95] * 4, 4)
        policy.observe(n, 0, 0.0, 0.1 * CPU(n), 0.1 * CPU(n)) if n else None
    assert policy.calibration.factor() < 0.6  # from 1.0, until gating stops verifying them
    assert policy.trim([0.95] * 4, 4) == 0
    assert FixedLength(3).trim([0.0, 0.0], 2) == 2  # fixed policies verify everything


def test_a_failed_probe_of_one_copying_source_warns_the_other() -> None:
    """Suffix tree and prompt lookup copy the same text: when the suffix tree's first
    probe fails (chat prose), prompt lookup, with no verdict of its own, is not probed
    at face value; and where the suffix tree's probes succeed, lookup starts trusted."""
    curve = CostCurve((1.0, 1.6, 2.2, 2.6, 3.1, 3.6, 4.2, 4.7, 5.2), 0.03)  # 2 threads, the 1.5B
    doubted = AdaptivePolicy(OnlineCost(curve, chunk=7, measure_t1=False), AdaptiveConfig(max_len=8),
                             cheap_drafter=True)
    assert doubted.trim([0.97] * 4, 4, "lookup") == 2  # alone, a confident lookup draft is probed
    n = doubted.trim([0.97] * 4, 4, "suffix")
    assert n == 2
    doubted.observe(n, 0, 0.0, 0.03 * curve(n), 0.03 * curve(n), source="suffix")
    assert doubted.calibration.factor("lookup") == doubted.calibration.factor("suffix") < 0.6
    assert doubted.trim([0.97] * 4, 4, "lookup") == 0
    trusted = AdaptivePolicy(OnlineCost(curve, chunk=7, measure_t1=False), AdaptiveConfig(max_len=8),
                             cheap_drafter=True)
    for _ in range(3):
        n = trusted.trim([0.97] * 4, 4, "suffix")
        trusted.observe(n, n, 0.0, 0.03 * curve(n), 0.03 * curve(n), source="suffix")
    assert trusted.calibration.factor("lookup") > 1.0


def test_short_matches_are_doubted_until_a_verdict_and_sure_runs_are_not() -> None:
    """Before any verdict a model-free draft is believed at its confidence cubed, its first
    token at most at UNPROVEN_FIRST: at 2 threads a 2-token match (confidence 0.75,
    accepted 27 % on chat) is not probed, a sure run is (a 2-token one not where 3 tokens
    cost 2.6 steps); on a cheap verify both are."""
    curve = CostCurve((1.0, 1.9, 2.2, 2.6, 3.1, 3.6, 4.2, 4.7, 5.2), 0.03)
    cpu = AdaptivePolicy(OnlineCost(curve, chunk=7, measure_t1=False), AdaptiveConfig(max_len=8),
                         cheap_drafter=True)
    assert cpu.calibration.believed(np.array([0.75, 0.999]), "suffix") == pytest.approx([0.75**3, 0.999**3])
    assert cpu.calibration.believed(np.array([0.999, 0.999]), "suffix") == pytest.approx([UNPROVEN_FIRST, 0.999**3])
    assert cpu.trim([0.75] * 4, 4, "suffix") == 0
    assert cpu.trim([0.999] * 4, 4, "suffix") == 2
    repacked = AdaptivePolicy(OnlineCost(CostCurve((1.0, 1.98, 2.58), 0.024), chunk=3, measure_t1=False),
                              AdaptiveConfig(max_len=8), cheap_drafter=True)
    assert repacked.trim([0.999] * 2, 2, "suffix") == 0  # 3 tokens for 2.58 steps: E = 2.6 at best
    gpu = AdaptivePolicy(OnlineCost(CostCurve.linear(0.05), chunk=7, measure_t1=False), AdaptiveConfig(max_len=8),
                         cheap_drafter=True)
    assert gpu.trim([0.75] * 4, 4, "suffix") == 2


def test_an_unproven_source_is_never_probed_on_a_draft_that_only_nearly_pays() -> None:
    """An occasional "nearly pays" probe (a draft predicted just short of the gain the
    policy asks for) is for a source whose verdicts may have under-calibrated it; for an
    unproven one it would bypass the promise a first probe must make (``probe_promise``):
    a failed probe costs c(k) - 1 steps for certain."""
    curve = CostCurve((1.0, 1.99, 2.72, 3.17, 3.69, 3.98, 4.62, 5.62, 6.6), 0.032)
    policy = AdaptivePolicy(OnlineCost(curve, chunk=7, measure_t1=False), AdaptiveConfig(max_len=8),
                            cheap_drafter=True)
    rates = policy.rates(policy.calibration.believed(np.full(6, 0.95), "suffix"), 0.0, 6)
    assert 1.0 < max(rates) < policy.config.min_gain  # it nearly pays
    assert max(rates) >= PROBE_WORTHY * policy.config.min_gain
    assert [policy.trim([0.95] * 6, 6, "suffix") for _ in range(40)] == [0] * 40


def test_no_model_free_draft_is_verified_where_none_could_pay() -> None:
    """One Zen 5 core verifying the 1.5B in 7-token chunks: k + 1 tokens cost k + 1 steps
    (learnt 1, 2, 3, 4, 4.92, 5.74, 6.57), so a draft that is never wrong gains at most
    6 %; drafting there lost 7-18 % on codegen. The same drafts go through where the
    verify is cheap (a memory-bound GPU-like curve)."""
    flat = CostCurve((1.0, 2.0, 3.0, 4.0, 4.92, 5.74, 6.57, 7.39, 8.21), 0.04)
    cost = OnlineCost(flat, chunk=7, measure_t1=False)
    policy = AdaptivePolicy(cost, AdaptiveConfig(max_len=8, free_max_len=32), cheap_drafter=True)
    assert policy.free_ceiling() < 1.1
    for _ in range(4):
        assert policy.trim([0.999] * 24, 24, "suffix") == 0
    cheap = AdaptivePolicy(OnlineCost(CostCurve.linear(0.1), chunk=7, measure_t1=False),
                           AdaptiveConfig(max_len=8, free_max_len=32), cheap_drafter=True)
    assert cheap.trim([0.999] * 24, 24, "suffix") > 0


def test_trust_is_not_earned_with_probes_that_cannot_pay() -> None:
    """Long drafts could pay here (7 tokens for 5 steps) but a 2-token probe costs its 3
    tokens' worth (c(2) = 3.0, one core): an unproven source is not verified at all,
    where a fresh strategy used to pay two failed probes per reply."""
    curve = CostCurve((1.0, 2.0, 3.0, 3.5, 4.0, 4.5, 5.0, 5.5, 6.0), 0.04)
    policy = AdaptivePolicy(OnlineCost(curve, chunk=7, measure_t1=False),
                            AdaptiveConfig(max_len=8, free_max_len=32, probe_every=1), cheap_drafter=True)
    assert policy.free_ceiling() >= 1.1 and not policy.probe_can_pay()
    assert all(policy.trim([0.99] * 12, 12, "suffix") == 0 for _ in range(5))


def test_mixed_chain_keeps_model_free_out_of_model_stats() -> None:
    policy = AdaptivePolicy(CPU, AdaptiveConfig(max_len=8, probe_every=1000), cheap_sources=frozenset({"suffix"}))
    for _ in range(40):  # the model drafter keeps failing: its budget goes to 0
        assert policy.next_length() == policy.config.free_max_len  # model-free drafters are still asked
        k = policy.model_budget
        if k:
            policy.observe(k, 0, 0.0, 0.1 * CPU(k), 0.1 * CPU(k), source="model:x")
    assert policy.model_budget == 0
    before = policy.acceptance().copy()
    for _ in range(2):  # the suffix source earns its trust with short prefixes
        n = policy.trim([0.99] * 8, 8, source="suffix")
        assert n == 2
        policy.observe(n, n, 0.0, 0.1 * CPU(n), 0.1 * CPU(n), source="suffix")
    n = policy.trim([0.99] * 8, 8, source="suffix")  # a confident suffix draft still goes through
    assert n >= 4
    policy.observe(n, n, 0.0, 0.1 * CPU(n), 0.1 * CPU(n), source="suffix")
    assert np.array_equal(policy.acceptance(), before)  # and does not touch the model's estimate


def test_untimed_round_teaches_acceptance_but_not_cost() -> None:
    """The first drafting round pays the drafter's catch-up on the whole prompt (and a GPU's
    first launches): one such outlier must not switch speculation off for good."""
    policy = AdaptivePolicy(CostCurve.linear(0.05, t1_s=0.01), AdaptiveConfig(max_len=8), draft_cost=0.1)
    before = policy.acceptance().copy()
    policy.observe(4, 4, draft_s=0.5, verify_s=0.012, round_s=0.52, timed=False)
    assert policy.draft_cost == 0.1 and policy.overhead == 0.0
    assert policy.acceptance()[0] > before[0]
    assert policy.next_length() > 0
    policy.observe(4, 4, draft_s=0.5, verify_s=0.012, round_s=0.52)  # the same round, timed
    assert policy.draft_cost > 1.0


def test_a_guessed_drafter_cost_gives_way_to_the_first_timed_round() -> None:
    """The weight-share guess leaves out each call's fixed cost and a cross-vocabulary
    drafter's translation (SmolLM2 guessed 0.09, timed 0.49): the first timed round
    replaces it; later rounds, and a cost that was measured, are averaged as before."""
    curve = CostCurve.linear(0.05, t1_s=0.01)
    guessed = AdaptivePolicy(curve, AdaptiveConfig(max_len=8), draft_cost=0.1, draft_cost_guessed=True)
    guessed.observe(4, 1, draft_s=4 * 0.005, verify_s=0.012, round_s=0.032, timed=False)
    assert guessed.draft_cost == 0.1  # an untimed round (the catch-up's) teaches no cost
    guessed.observe(4, 1, draft_s=4 * 0.005, verify_s=0.012, round_s=0.032)  # half a step a token
    assert guessed.draft_cost == pytest.approx(0.5)
    guessed.observe(4, 1, draft_s=4 * 0.003, verify_s=0.012, round_s=0.024)
    assert guessed.draft_cost == pytest.approx(0.8 * 0.5 + 0.2 * 0.3)
    measured = AdaptivePolicy(curve, AdaptiveConfig(max_len=8), draft_cost=0.1)
    measured.observe(4, 1, draft_s=4 * 0.005, verify_s=0.012, round_s=0.032)
    assert measured.draft_cost == pytest.approx(0.8 * 0.1 + 0.2 * 0.5)


class SlowToy(ToyBackend):
    """A toy whose every call takes at least ``step_s``: a small model's fixed cost per call."""

    def __init__(self, table: np.ndarray, step_s: float, **kwargs) -> None:
        super().__init__(table, **kwargs)
        self.step_s = step_s

    def evaluate(self, tokens, logits_for=None):
        time.sleep(self.step_s)
        return super().evaluate(tokens, logits_for)


def test_the_guess_counts_what_a_drafter_call_costs_beyond_its_weights() -> None:
    """A drafter with a twentieth of the target's weights whose one-token call takes at
    least as long as the target's step is guessed at a step a token, not a twentieth; its
    cache is left as it was. Without the target's measured step the weights decide."""
    from tandem.runtime.speculative.drafters.model import ModelDrafter
    from tandem.runtime.speculative.factory import drafter_call_cost, guessed_draft_cost

    rng = np.random.default_rng(0)
    target = ToyBackend(random_table(64, rng))
    slow = SlowToy(random_table(16, rng), step_s=0.02, n_ctx=64)
    slow.evaluate([1, 2, 3])
    drafter = ModelDrafter(slow)
    share = slow.table.nbytes / target.table.nbytes
    assert share < 0.1
    assert guessed_draft_cost(drafter, target, drafter_call_cost(drafter, target_step_s=0.02)) >= 1.0
    assert slow.tokens == [1, 2, 3]
    assert drafter_call_cost(drafter, target_step_s=None) is None
    assert guessed_draft_cost(drafter, target, None) == pytest.approx(share)
    full = SlowToy(random_table(16, rng), step_s=0.0, n_ctx=4)
    full.evaluate([1, 2])  # no room for the timed calls: the weights decide
    assert drafter_call_cost(ModelDrafter(full), 0.02) is None


def test_a_drafters_call_is_timed_once_per_pair_and_machine(stories260k: Path, monkeypatch) -> None:
    """The call the guess times is cached with the drafter's other costs: the next
    strategy for the pair starts from it without timing the drafter again."""
    from tandem.runtime.speculative import factory
    from tandem.runtime.speculative.cost_cache import cached_drafter_costs, remember_cost_curve

    timed: list[float] = []

    def counted(backend, reps: int = 3) -> float | None:
        timed.append(step := one_token_step_s(backend, reps))
        return step

    monkeypatch.setattr(factory, "one_token_step_s", counted)
    with LlamaCppBackend(stories260k, LlamaConfig(n_ctx=256, n_threads=1)) as target:
        remember_cost_curve(target, CostCurve.linear(0.05, t1_s=0.01))  # the target's step, measured
        first = factory.build_strategy(target, stories260k, factory.SpecOptions(mode="model"))
        assert len(timed) == 1 and timed[0] is not None
        assert isinstance(first.policy, AdaptivePolicy) and first.policy.draft_cost_guessed
        name, size = first.drafter.name, first.drafter.weight_bytes()
        first.close()  # nothing drafted: only the call is known
        cached = cached_drafter_costs(target, name, size)
        assert cached is not None and cached.draft_cost is None
        assert cached.call_cost == pytest.approx(timed[0] / 0.01)
        second = factory.build_strategy(target, stories260k, factory.SpecOptions(mode="model"))
        try:
            assert len(timed) == 1  # not timed again
            assert isinstance(second.policy, AdaptivePolicy)
            assert second.policy.draft_cost == pytest.approx(first.policy.draft_cost)
        finally:
            second.close()


def test_predraft_only_where_the_acceptance_outlook_allows() -> None:
    """Drafting faster than verifying: pre-drafting is free, always on. Drafting slower:
    a rejected pre-draft delays the next round, so it needs a likely hit."""
    cheap = AdaptivePolicy(CostCurve.linear(0.05), AdaptiveConfig(max_len=8), draft_cost=0.05)
    assert cheap.predraft_pays(4) and not cheap.predraft_pays(0)
    dear = AdaptivePolicy(CostCurve.linear(0.05), AdaptiveConfig(max_len=8), draft_cost=0.6)
    dear.reached[:] = 100
    dear.accepted[:] = 98
    assert dear.predraft_pays(4)
    dear.accepted[:] = 30
    assert not dear.predraft_pays(4)
    assert FixedLength(4).predraft_pays(4)


def test_the_policy_s_prices_follow_every_verify_time_it_learns() -> None:
    """A verify that turns out cheap raises at once what a perfect draft could gain, and
    the policy drafts again where it had given up."""
    cost = OnlineCost(CostCurve.linear(1.0, t1_s=0.02))
    policy = AdaptivePolicy(cost, AdaptiveConfig(max_len=8))
    assert policy.ceiling() == pytest.approx(1.0)  # k + 1 tokens for k + 1 steps: nothing to gain
    assert policy.best_length() == 0
    for _ in range(3):
        cost.observe(0, 0.020)
        cost.observe(8, 0.030)
    assert policy.ceiling() == pytest.approx(9 / 1.5)
    assert policy.best_length() > 0


def test_online_cost_learns_the_run_s_own_verify_times() -> None:
    """A stale prior (here: verification as dear as decoding) corrects itself from the
    calls the run makes; until then the prior answers, so nothing is measured up front."""
    cost = OnlineCost(CostCurve.linear(1.0, t1_s=0.02))
    assert cost(3) == 4.0 and not cost.learnt
    for _ in range(5):
        cost.observe(0, 0.010)
        cost.observe(3, 0.015)
    assert cost.learnt
    assert abs(cost.t1_s - 0.010) < 1e-9
    assert abs(cost(3) - 1.5) < 1e-6
    assert cost(5) == pytest.approx(1 + 5 / 6)  # never seen: the prior, scaled as far off as seen (1/6)
    assert cost.curve().c[3] == pytest.approx(1.5)


def test_chunked_verification_costs_the_chunks_it_reaches() -> None:
    """With exact_batch 7 a 20-token draft is verified in chunks; greedy stops after the
    chunk with the first rejection, so a long draft that fails early costs one chunk."""
    cost = OnlineCost(CostCurve.linear(0.2), chunk=7)
    assert cost(20) == pytest.approx(3 * cost(6))  # 21 tokens: three calls of 7
    sure = np.ones(20)
    early = np.r_[np.zeros(1), np.ones(19)]
    assert cost.expected_verify(20, sure) == pytest.approx(cost(20))
    assert cost.expected_verify(20, early) == pytest.approx(cost(6))


@pytest.mark.parametrize("chunk", [None, 1, 3, 7])
def test_expected_verify_of_every_length_sums_the_chunks_each_reaches(chunk: int | None) -> None:
    """The one-pass prices of every length equal the chunk-by-chunk definition: chunk j
    (from feed position s) is paid with the probability that the s drafts before it
    were accepted, and acceptance rates shorter than the draft keep their last reach."""
    cost = OnlineCost(CostCurve((1.0, 1.9, 2.3, 2.9, 3.1, 3.8, 4.7, 5.6, 6.6), 0.03), chunk=chunk)
    a = np.random.default_rng(7).uniform(0.3, 1.0, size=12)
    n = 20
    reach = [1.0, *np.cumprod(a)]
    for k, got in enumerate(cost.expected_verify_upto(a, n)):
        step = chunk or k + 1
        starts = range(0, k + 1, step)
        want = sum(reach[min(s, len(a))] * cost.call(min(step, k + 1 - s) - 1) for s in starts)
        assert got == pytest.approx(want), k


def test_a_free_draft_competes_with_the_model_drafter() -> None:
    """Next to a good, cheap model drafter a weak suffix draft is passed over (the model
    drafts instead); next to a failing one the same draft is verified, priced without
    the model's drafting cost."""
    good = AdaptivePolicy(CostCurve.linear(0.1), AdaptiveConfig(max_len=8), draft_cost=0.05,
                          cheap_sources=frozenset({"suffix"}))
    good.reached[:] = 100
    good.accepted[:] = 95
    good.next_length()
    assert good.model_budget and good.model_budget > 0
    assert good.trim([0.6, 0.5], 2, source="suffix") == 0
    bad = AdaptivePolicy(CostCurve.linear(0.1), AdaptiveConfig(max_len=8, probe_every=1000), draft_cost=2.0,
                         cheap_sources=frozenset({"suffix"}))
    bad.reached[:] = 100
    bad.accepted[:] = 5
    bad.next_length()
    assert bad.model_budget == 0
    assert bad.trim([0.6, 0.5], 2, source="suffix") > 0


def test_plain_rounds_measure_t1_before_and_between_speculation() -> None:
    """Inferred from the prior, t1 would make every learnt c(k) equal the prior's: the
    policy asks for plain rounds until it has measured one-token calls, and again after
    ``t1_refresh`` speculative calls."""
    policy = AdaptivePolicy(OnlineCost(CostCurve.linear(0.1), t1_refresh=4), AdaptiveConfig(max_len=8),
                            cheap_drafter=True)
    assert policy.next_length() == 0
    policy.observe(0, 0, 0.0, 0.010, 0.010)
    assert policy.next_length() == 0
    policy.observe(0, 0, 0.0, 0.010, 0.010)
    assert policy.next_length() > 0
    for _ in range(4):
        policy.observe(3, 3, 0.0, 0.030, 0.030)
    assert policy.next_length() == 0
    assert policy.cost(3) == pytest.approx(3.0)  # learnt against the measured t1, not the prior's 1.3


def test_first_strategy_times_the_target_while_decoding_and_caches_it(stories260k: Path) -> None:
    """No cached c(k): the first strategy times nothing before the first token (its first
    call is the first token's own), times its first sizes in the rounds after, and
    caches the curve at close; the next one starts from it and times nothing."""
    from tandem.kernels.sampling import Sampler
    from tandem.kernels.sampling_params import SamplingParams
    from tandem.runtime.generate import generate
    from tandem.runtime.speculative.cost_cache import cached_cost_curve
    from tandem.runtime.speculative.factory import SpecOptions, build_strategy

    with LlamaCppBackend(stories260k, LlamaConfig(n_ctx=256, n_threads=1)) as target:
        assert cached_cost_curve(target) is None
        first = build_strategy(target, None, SpecOptions(mode="ngram"))
        assert target.tokens == [] and first.policy.cost.wants_size() == 0  # t1 first, from plain rounds
        prompt = target.tokenize("Once upon a time", add_bos=True)
        # 16 tokens: room for the 6-draft call after the t1 rounds, and for the smaller
        # sizes after it even when all its padding is accepted (FIRST_SIZES, largest first).
        events = list(generate(target, prompt, Sampler(SamplingParams.greedy_params()), strategy=first,
                               max_tokens=16, stop_at_eog=False))
        # 16 tokens, however they came (drafts another test taught the process's suffix memory
        # arrive several to an event), then the end
        assert sum(len(e.tokens) for e in events[:-1]) == 16 and first.policy.cost.timed
        first.close()
        curve = cached_cost_curve(target)
        assert curve is not None and curve.c[0] == 1.0 and list(curve.c) == sorted(curve.c)
        second = build_strategy(target, None, SpecOptions(mode="ngram"))
        assert second.policy.cost.timed and second.policy.cost.prior == curve
        second.close()


def test_a_reply_too_short_to_time_the_target_caches_nothing(stories260k: Path) -> None:
    from tandem.kernels.sampling import Sampler
    from tandem.kernels.sampling_params import SamplingParams
    from tandem.runtime.generate import generate
    from tandem.runtime.speculative.cost_cache import cached_cost_curve
    from tandem.runtime.speculative.factory import SpecOptions, build_strategy

    with LlamaCppBackend(stories260k, LlamaConfig(n_ctx=256, n_threads=1)) as target:
        strategy = build_strategy(target, None, SpecOptions(mode="ngram"))
        prompt = target.tokenize("Once upon a time", add_bos=True)
        list(generate(target, prompt, Sampler(SamplingParams.greedy_params()), strategy=strategy, max_tokens=3,
                      stop_at_eog=False))
        strategy.close()
        assert not strategy.policy.cost.timed and cached_cost_curve(target) is None


def test_a_drafter_cost_learnt_in_one_strategy_seeds_the_next(stories260k: Path) -> None:
    """A fresh strategy prices its model drafter by weight share until rounds time it; what
    they learnt (its cost per drafted and per caught-up token, and the verify curve learnt
    while decoding) is cached at close, so the next strategy for this target, drafter and
    machine starts from it: a drafter that cannot pay here is then not probed again by
    every new conversation."""
    from tandem.runtime.speculative.cost_cache import cached_drafter_costs
    from tandem.runtime.speculative.factory import SpecOptions, build_strategy

    with LlamaCppBackend(stories260k, LlamaConfig(n_ctx=256, n_threads=1)) as target:
        first = build_strategy(target, stories260k, SpecOptions(mode="model"))
        policy = first.policy
        assert isinstance(policy, AdaptivePolicy)
        prior = policy.draft_cost
        assert prior == pytest.approx(1.0, rel=0.05)  # the drafter is the target's own file
        assert policy.draft_cost_guessed
        for _ in range(2):
            policy.observe(0, 0, 0.0, 0.010, 0.010)  # plain rounds: the one-token time
        for k in FIRST_SIZES:  # the target's first sizes, timed in padded rounds
            policy.observe(0, 0, 0.0, 0.010 + 0.0025 * k, 0.010 + 0.0025 * k, evaluated=k + 1)
        for _ in range(6):
            policy.observe(4, 1, draft_s=4 * 0.030, verify_s=0.020, round_s=0.150)  # 3 steps a token
        assert policy.draft_timed == 6 and policy.draft_cost > 2.0
        policy.observe_catch_up("model", 100, 100 * 0.25 * 0.010)  # a quarter step per caught-up token
        learnt = policy.draft_cost
        name, size = first.drafter.name, first.drafter.weight_bytes()
        first.close()
        cached = cached_drafter_costs(target, name, size)
        assert cached is not None and cached.draft_cost == pytest.approx(learnt)
        assert cached.catch_up_cost == pytest.approx(0.25)
        second = build_strategy(target, stories260k, SpecOptions(mode="model"))
        try:
            assert isinstance(second.policy, AdaptivePolicy)
            assert second.policy.draft_cost == pytest.approx(learnt) and not second.policy.draft_cost_guessed
            assert second.policy.catch_up_per_token() == pytest.approx(0.25)
            assert second.policy.cost.call(4) == pytest.approx(2.0)  # the learnt c(4), not the prior
        finally:
            second.close()
        plain_cost = build_strategy(target, None, SpecOptions(mode="ngram"))  # no model drafter: nothing to seed
        assert isinstance(plain_cost.policy, AdaptivePolicy) and plain_cost.policy.draft_cost == 0.0
        plain_cost.close()


def test_only_what_was_timed_is_remembered_of_a_drafter(stories260k: Path) -> None:
    """A strategy that timed only its drafter's catch-up caches that, not the weight-share
    guess that stood in for the cost per drafted token: the next strategy still starts from
    the guess (and would not, were the guess stored as if measured, ever tell them apart)."""
    from tandem.runtime.speculative.cost_cache import cached_drafter_costs
    from tandem.runtime.speculative.factory import SpecOptions, build_strategy

    with LlamaCppBackend(stories260k, LlamaConfig(n_ctx=256, n_threads=1)) as target:
        first = build_strategy(target, stories260k, SpecOptions(mode="model"))
        assert isinstance(first.policy, AdaptivePolicy)
        prior = first.policy.draft_cost
        for _ in range(2):
            first.policy.observe(0, 0, 0.0, 0.010, 0.010)  # plain rounds: the one-token time
        first.policy.observe_catch_up("model", 100, 100 * 0.25 * 0.010)  # nothing drafted: only the catch-up timed
        assert first.policy.draft_timed == 0
        name, size = first.drafter.name, first.drafter.weight_bytes()
        first.close()
        cached = cached_drafter_costs(target, name, size)
        assert cached is not None and cached.draft_cost is None
        assert cached.catch_up_cost == pytest.approx(0.25)
        forced = build_strategy(target, stories260k, SpecOptions(mode="model", draft_cost=5.0))
        assert isinstance(forced.policy, AdaptivePolicy) and forced.policy.draft_cost == 5.0
        assert not forced.policy.draft_cost_guessed
        forced.close()  # a cost the caller set is not a measurement either
        cached = cached_drafter_costs(target, name, size)
        assert cached is not None and cached.draft_cost is None
        second = build_strategy(target, stories260k, SpecOptions(mode="model"))
        try:
            assert isinstance(second.policy, AdaptivePolicy)
            assert second.policy.draft_cost == pytest.approx(prior)
            assert second.policy.catch_up_per_token() == pytest.approx(0.25)
        finally:
            second.close()


def test_a_saved_curve_is_the_median_of_the_runs_own_values() -> None:
    """One run's call of a size is a sample, not the truth: a spike does not make the
    size look dear for good (a dear-looking size is never called again to correct it),
    while a prior slightly too cheap moves as each run confirms it."""
    prior = CostCurve((1.0, 1.94, 2.87, 3.58, 4.31, 5.03, 5.75, 6.47, 7.19), 0.04)
    cost = OnlineCost(prior, chunk=7)
    cost.observe(0, 0.040)
    cost.observe(0, 0.040)
    cost.observe(2, 0.120)  # c(2) = 3.0, seen once
    assert cost.call(2) == pytest.approx(2.87)  # not trusted within the run
    assert cost.observed() == {}  # t1 from two calls: not enough to save a ratio by
    for _ in range(T1_CALLS_TO_SAVE - 2):
        cost.observe(0, 0.040)
    assert cost.observed() == {2: pytest.approx(3.0)}
    saved, runs = merge_runs(prior, {}, cost.curve(), cost.observed())
    assert saved.c[2] == pytest.approx((2.87 + 3.0) / 2) and runs == {2: [2.87, pytest.approx(3.0)]}
    saved, runs = merge_runs(saved, runs, cost.curve(), cost.observed())
    assert saved.c[2] == pytest.approx(3.0)  # confirmed by a second run
    spiked, runs = merge_runs(saved, runs, cost.curve(), {2: 3.46})
    assert spiked.c[2] == pytest.approx(3.0) and len(runs[2]) == 4
    for _ in range(6):
        spiked, runs = merge_runs(spiked, runs, cost.curve(), {2: 2.3})
    assert spiked.c[2] == pytest.approx(2.3) and len(runs[2]) == SAVED_RUNS
    assert list(spiked.c) == sorted(spiked.c)
    # sizes no run called lie on the curve through those that were: 1 + 0.65 k here
    assert spiked.c[1] == pytest.approx(1.65) and spiked.c[3] == pytest.approx(2.95)


def test_a_size_no_run_called_does_not_lift_the_saved_curve() -> None:
    """Seen in this machine's cache: one run priced the never-called c(4) at its cap, 5.0,
    and saving that made c(5) and c(6) 5.0 too where their runs measured 3.6 and 4.4
    (so 3 drafts looked as cheap as 2, and 4-token matches were probed and failed)."""
    history = {1: [1.92, 1.96], 2: [2.17, 2.72, 2.77, 2.90], 3: [2.53, 2.68, 3.20, 3.22],
               5: [3.49, 3.58, 4.29], 6: [4.16, 4.68, 4.41, 4.71]}
    run = CostCurve((1.0, 1.9, 2.7, 2.9, 5.0, 5.0, 5.0, 8.0, 9.0), 0.034)
    saved, _ = merge_runs(None, history, run, {})
    medians = {k: float(np.median(v)) for k, v in history.items()}
    assert saved.c[5] == pytest.approx(medians[5]) and saved.c[6] == pytest.approx(medians[6])
    assert medians[3] < saved.c[4] < medians[5]
    assert list(saved.c) == sorted(saved.c) and saved.t1_s == run.t1_s


def test_a_run_far_off_the_others_is_left_out_of_the_saved_curve() -> None:
    """A run that saved c(3) = 1.02 beside runs of 2.5-3.2 (its one-token time caught by
    a burst of load) does not pull the median a rank towards it."""
    run = CostCurve((1.0, 2.0, 2.7, 3.2, 3.7), 0.034)
    saved, kept = merge_runs(None, {3: [2.53, 2.68, 3.20, 3.22]}, run, {3: 1.02})
    assert kept[3][-1] == 1.02 and saved.c[3] == pytest.approx((2.68 + 3.20) / 2)
    # a lasting change wins once it is most of the runs
    for _ in range(3):
        saved, kept = merge_runs(saved, kept, run, {3: 6.5})
    assert saved.c[3] == pytest.approx(6.5)


def test_the_cost_cache_keeps_the_run_history(stories260k: Path) -> None:
    from tandem.runtime.speculative.cost_cache import cached_cost_curve, remember_cost_curve

    with LlamaCppBackend(stories260k, LlamaConfig(n_ctx=64, n_threads=1)) as target:
        run = CostCurve((1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0), 0.001)
        for value in (2.2, 2.4, 9.0):
            remember_cost_curve(target, run, {1: value})
        assert cached_cost_curve(target).c[1] == pytest.approx(2.3)  # 9.0 kept, but left out
        from tandem.models.paths import cache_dir

        table = json.loads((cache_dir() / "verify_cost.json").read_text())
        entry = next(iter(table.values()))
        assert entry["runs"]["1"] == [2.2, 2.4, 9.0]
        entry["runs"] = {"1": "garbage"}
        (cache_dir() / "verify_cost.json").write_text(json.dumps(table))
        remember_cost_curve(target, run, {1: 2.0})  # a damaged history starts again
        assert cached_cost_curve(target).c[1] == pytest.approx(2.0)
