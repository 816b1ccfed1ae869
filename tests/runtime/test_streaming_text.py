"""Streaming text: UTF-8 never split, stop strings never leak, nothing lost."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tandem.runtime.streaming_text import Detokenizer, StopMatcher


def test_detokenizer_holds_partial_utf8() -> None:
    pieces = {0: "é".encode()[:1], 1: "é".encode()[1:], 2: b"!"}
    d = Detokenizer(pieces.__getitem__)
    assert d.add([0]) == ""
    assert d.add([1, 2]) == "é!"
    assert d.flush() == ""


@given(st.text(max_size=60), st.integers(min_value=1, max_value=7))
def test_detokenizer_byte_chunks_reassemble(text: str, chunk: int) -> None:
    data = text.encode()
    pieces = [data[i : i + chunk] for i in range(0, len(data), chunk)]
    d = Detokenizer(pieces.__getitem__)
    out = "".join(d.add([i]) for i in range(len(pieces))) + d.flush()
    assert out == text


@given(
    st.text(alphabet="ab\nXY", max_size=40),
    st.lists(st.text(alphabet="ab\nXY", min_size=1, max_size=4), max_size=3),
    st.integers(min_value=1, max_value=5),
)
def test_stop_matcher_emits_exactly_text_before_first_stop(text: str, stops: list[str], chunk: int) -> None:
    m = StopMatcher(stops)
    shown, hit = [], False
    for i in range(0, len(text), chunk):
        out, hit = m.feed(text[i : i + chunk])
        shown.append(out)
        if hit:
            break
    if not hit:
        shown.append(m.flush())
    # Generation stops as soon as a stop string is complete; the cut is the earliest
    # stop string present in the text seen by then.
    end = next((n for n in range(1, len(text) + 1) if any(s in text[:n] for s in stops)), None)
    first = None if end is None else min(i for i in (text[:end].find(s) for s in stops) if i >= 0)
    expected = text if first is None else text[:first]
    assert "".join(shown) == expected
    assert hit == (first is not None)
