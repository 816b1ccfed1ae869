"""benchmarks/host_overhead.py: its target hands out the real vocabulary's rows and stands
for the device time it is given; drafting changes no token of its replies."""

from __future__ import annotations

from benchmarks.host_overhead import FreeTarget, run


def test_drafts_pay_on_text_that_repeats_and_change_no_token() -> None:
    for text in ("fresh", "repeat"):
        target = FreeTarget(text, step_s=0.0005)
        plain = run(target, "plain", 160)
        drafted = run(target, "ngram", 160)
        assert drafted.tokens == plain.tokens and len(plain.tokens) == 160
        assert plain.tokens_per_call == 1.0
        if text == "repeat":
            assert len(set(plain.tokens)) == 64  # a cycle of 64 rows, seen 2.5 times
            assert drafted.tokens_per_call > 1.5
        for r in (plain, drafted):
            assert 0 < r.host_us_per_token < r.us_per_token
    assert target.device_s > 160 * 0.0005  # both replies' calls stood for device time
