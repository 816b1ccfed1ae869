"""Model-free sources rest after their drafts keep being trimmed to nothing: asking them
costs the host a proposal and its pricing every round, which on a GPU's 2 ms step made
drafting that never pays slower than plain decoding (``benchmarks/host_overhead.py``)."""

from __future__ import annotations

import numpy as np

from tandem.runtime.speculative.cost import CostCurve
from tandem.runtime.speculative.policy.adaptive import AdaptivePolicy
from tandem.runtime.speculative.policy.adaptive_config import ASKING_DEAR, AdaptiveConfig
from tandem.runtime.speculative.policy.rests import RestSchedule

GPU = CostCurve((1.0, 1.07, 1.22, 1.41, 1.52, 1.64, 1.77, 1.89, 1.98), 0.002)
"""A flat verify cost (the 1.5B on an H200): drafts could pay, so each is priced."""


def rounds_asked(schedule: RestSchedule, verdicts: list[int], source: str = "suffix") -> list[int]:
    """Rounds (0-based) in which ``source`` is asked, its drafts judged in turn by ``verdicts``."""
    asked, pending = [], iter(verdicts)
    for r in range(200):
        schedule.next_round()
        if schedule.resting(source):
            continue
        kept = next(pending, None)
        if kept is None:
            break
        asked.append(r)
        schedule.judged(source, kept)
    return asked


def test_vain_asks_earn_rests_twice_as_long_up_to_the_longest() -> None:
    schedule = RestSchedule(after=4, longest=8)
    asked = rounds_asked(schedule, [0] * 8)
    # four asks in a row, then rests of 2, 4, 8, 8 rounds between single asks
    assert asked == [0, 1, 2, 3, 6, 11, 20, 29]


def test_one_kept_draft_ends_the_rest_and_the_count() -> None:
    schedule = RestSchedule(after=4, longest=8)
    asked = rounds_asked(schedule, [0, 0, 0, 0, 0, 3, 0, 0, 0, 0])
    assert asked == [0, 1, 2, 3, 6, 11, 12, 13, 14, 15]  # after the kept draft: four asks again before resting
    other = RestSchedule()
    other.judged("suffix", 0)
    assert not other.resting("lookup")  # per source


def test_a_policy_stops_pricing_drafts_that_never_pay_but_takes_one_that_does() -> None:
    """Low-confidence drafts on a flat verify cost are priced and refused: after a few the
    source rests, so far fewer of 64 rounds ask it; a confident draft asked after a rest is
    kept, and the source is asked every round again. Measured sources (a prediction) are
    the client's word: never rested."""
    policy = AdaptivePolicy(GPU, AdaptiveConfig(), cheap_drafter=True, measured_sources=frozenset({"prediction"}))
    for _ in range(10):  # rounds that asked and drafted nothing, asking took 0.4 ms of a 2 ms step
        assert policy.length_for("suffix", policy.next_length())
        policy.observe(0, 0, 0.0004, 0.002, 0.0025, "suffix")
    assert policy.asking_cost >= ASKING_DEAR
    weak, strong = np.full(8, 0.02), np.full(8, 0.999)
    asked = {"suffix": 0, "prediction": 0}
    for _ in range(64):
        k = policy.next_length()
        for source in asked:
            if policy.length_for(source, k):
                asked[source] += 1
                assert policy.trim(weak, 8, source) == 0
    assert asked["prediction"] == 64
    assert asked["suffix"] < 20
    dear = policy.asking_cost
    for _ in range(20):  # rounds no source was asked in cost nothing to ask: they teach nothing
        policy.next_length()
        policy.observe(0, 0, 0.0, 0.002, 0.002, "")
    assert policy.asking_cost == dear
    while not policy.length_for("suffix", policy.next_length()):
        pass
    policy.calibration.measured = frozenset({"suffix"})  # trusted now: a confident draft pays
    assert policy.trim(strong, 8, "suffix") > 0
    assert all(policy.length_for("suffix", policy.next_length()) for _ in range(8))


def test_where_asking_is_cheap_against_a_step_every_source_is_asked_every_round() -> None:
    """On a CPU step (tens of ms) asking costs under 1 %: a rest would only delay the start
    of a copied run, so sources whose drafts are refused are still asked every round."""
    policy = AdaptivePolicy(CostCurve(GPU.c, 0.080), AdaptiveConfig(), cheap_drafter=True)
    for _ in range(10):
        assert policy.length_for("suffix", policy.next_length())
        policy.observe(0, 0, 0.0004, 0.080, 0.081, "suffix")
    assert 0 < policy.asking_cost < ASKING_DEAR
    asked = 0
    for _ in range(32):
        k = policy.next_length()
        if policy.length_for("suffix", k):
            asked += 1
            policy.trim(np.full(8, 0.02), 8, "suffix")
    assert asked == 32
