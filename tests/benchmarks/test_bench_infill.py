"""The /infill benchmark's corpus: 30 holes, 60 llama.vim-shaped requests, exact-match judging."""

from __future__ import annotations

from benchmarks.infill import percentile, requests_for, typing_requests
from benchmarks.infill_corpus import SNIPPETS, fill_matches, holes, parse_hole


def test_corpus_shape() -> None:
    corpus = holes()
    assert len(corpus) == 30
    assert sum(h.multi_line for h in corpus) == 4  # four of the ten block bodies span several lines
    assert sum(h.prompt.strip() == "" for h in corpus) == 11  # the block bodies and one whole statement
    for snippet, h in zip(SNIPPETS, corpus, strict=True):
        assert h.prefix + h.prompt + h.answer + h.suffix == snippet.replace("⟪", "").replace("⟫", "")
        assert "\n" not in h.prompt and h.answer.strip()
    reqs = requests_for(corpus)
    assert len(reqs) == 60
    assert sum(bool(r["input_extra"]) for r in reqs) == 30
    assert all(r["n_indent"] == corpus[r["_hole"]].indent for r in reqs)


def test_fill_matches_is_exact_on_the_hole_lines() -> None:
    h = parse_hole("def f(x):\n    ⟪if x:\n        return 1⟫\n    return 0\n")
    assert (h.prompt, h.indent, h.multi_line) == ("    ", 4, True)
    assert fill_matches(h, "if x:\n        return 1\n    return 0")  # what follows is not judged
    assert fill_matches(h, "if x:  \n        return 1")
    assert not fill_matches(h, "if x:\n        return 2")
    assert not fill_matches(h, "if x:")


def test_percentile() -> None:
    xs = [float(i) for i in range(1, 101)]
    assert percentile(xs, 0.5) in (50.0, 51.0) and percentile(xs, 0.95) in (95.0, 96.0)


def test_typing_session_grows_the_cursor_line() -> None:
    corpus = holes()
    session = typing_requests(corpus, n_holes=2, step=4)
    first = [r for r in session if r["_hole"] == 0]
    assert [r["prompt"] for r in first] == ["    return ", "    return a + "]  # answer "a + b"
    assert all(r["input_prefix"] == corpus[0].prefix and r["input_suffix"] == corpus[0].suffix for r in first)
