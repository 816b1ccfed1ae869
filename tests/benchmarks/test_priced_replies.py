"""benchmarks/priced_replies.py: a reply's speculation priced from its calls and drafts."""

from __future__ import annotations

import pytest

from benchmarks.priced_replies import priced, slope


def test_the_slope_is_the_dearest_draft_on_the_curve() -> None:
    assert slope([1.0, 1.72, 1.84, 2.93]) == pytest.approx(0.72)
    assert slope([1.0, 1.1, 1.3, 2.5]) == pytest.approx(0.5)  # (2.5 - 1) / 3


def test_a_reply_is_priced_against_plain_decodings_steps() -> None:
    runs = [
        {"config": "plain", "target_calls": 64, "drafted": 0},
        {"config": "ngram", "target_calls": 64, "drafted": 0},  # drafted nothing: plain's cost
        {"config": "ngram", "target_calls": 64, "drafted": 2},  # one failed probe of 2: a dearer call
        {"config": "auto+model", "target_calls": 32, "drafted": 32},  # every draft accepted
    ]
    out = priced(runs, [1.0, 1.5, 2.0], tokens=64)
    assert set(out) == {"ngram", "auto+model"}
    assert out["ngram"] == pytest.approx([1.0, 64 / 65])
    assert out["auto+model"] == pytest.approx([64 / 48])
