"""N-gram tables: counts against a brute-force count, storage round trip, and the CLI."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.app.cli import main
from tandem.errors import ModelFormatError
from tandem.models.ngram import NgramModel, find_for, ngram_dir, tokenizer_fingerprint


def _brute_prob(docs: list[list[int]], context: tuple[int, ...], token: int) -> float:
    c = len(context)
    follow: Counter[int] = Counter()
    for d in docs:
        for i in range(c, len(d)):
            if tuple(d[i - c : i]) == context:
                follow[d[i]] += 1
    total = sum(follow.values())
    return follow[token] / total if total else 0.0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=30), min_size=1, max_size=4),
       st.lists(st.integers(0, 5), min_size=0, max_size=6))
def test_probabilities_match_brute_force_counts(docs: list[list[int]], context: list[int]) -> None:
    model = NgramModel.build(docs, n_vocab=6)
    cands = np.arange(6)
    for j in range(1, 6):
        if j > len(context):
            continue
        weights = [0.0] * 5
        weights[j - 1] = 1.0
        got = model.probs(context, cands, weights)
        want = [_brute_prob(docs, tuple(context[-j:]), t) for t in range(6)]
        assert got.tolist() == pytest.approx(want)


def test_unigrams_and_interpolation() -> None:
    docs = [[1, 2, 3, 1, 2, 4], [1, 2, 3]]
    model = NgramModel.build(docs, n_vocab=5)
    assert model.unigram_prob(np.array([1, 2, 3, 4, 0])).tolist() == pytest.approx([3 / 9, 3 / 9, 2 / 9, 1 / 9, 0])
    # after [1, 2]: 3 twice, 4 once (bigram ctx [2] and trigram ctx [1, 2] agree)
    p = model.probs([1, 2], np.array([3, 4, 0]), (0.25, 0.5))
    assert p.tolist() == pytest.approx([0.75 * 2 / 3, 0.75 * 1 / 3, 0.0])


def test_ngrams_never_cross_documents() -> None:
    model = NgramModel.build([[1, 2], [3, 4]], n_vocab=5)
    assert model.probs([2], np.array([3]), (1.0,)).tolist() == [0.0]


def test_save_load_round_trip_and_lookup(tmp_path) -> None:
    docs = [[1, 2, 3, 4, 5, 6, 7, 1, 2, 3], [7, 7, 7]]
    model = NgramModel.build(docs, n_vocab=8, fingerprint="abc123", sources=["x.txt"])
    path = model.save(ngram_dir() / "mine-abc123.npz")
    loaded = NgramModel.load(path)
    assert loaded.meta == model.meta
    for ctx in ([1, 2], [7], [4, 5, 6, 7, 1]):
        assert loaded.probs(ctx, np.arange(8), (0.1, 0.2, 0.3, 0.2, 0.2)).tolist() == pytest.approx(
            model.probs(ctx, np.arange(8), (0.1, 0.2, 0.3, 0.2, 0.2)).tolist())
    assert find_for("abc123") == path
    assert find_for("other") is None
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    with pytest.raises(ModelFormatError):
        NgramModel.load(bad)


def test_cli_build_from_files_and_list(stories260k, tmp_path, capsys) -> None:
    (tmp_path / "a.txt").write_text("Once upon a time, there was a little cat. The cat was happy.\n")
    sub = tmp_path / "notes"
    sub.mkdir()
    (sub / "b.md").write_text("Lily liked to play in the park with her dog.\n")
    (sub / "blob.bin").write_bytes(b"\0\1\2binary")
    rc = main(["ngram", "build", str(tmp_path), "-m", str(stories260k), "--name", "notes"])
    assert rc == 0
    assert "Built n-gram model 'notes'" in capsys.readouterr().out
    from tandem.runtime.backends.llama import LlamaCppBackend
    from tandem.runtime.backends.llama_config import LlamaConfig

    with LlamaCppBackend(stories260k, LlamaConfig(n_ctx=64)) as b:
        fp = tokenizer_fingerprint(b.n_vocab, b.token_bytes)
        path = find_for(fp, "notes")
        assert path is not None
        model = NgramModel.load(path)
        ids = b.tokenize("The cat was happy.")
        assert model.n_tokens == sum(len(b.tokenize(t)) for t in (
            (tmp_path / "a.txt").read_text(), (sub / "b.md").read_text()))
        assert model.probs(ids[:3], np.array([ids[3]]), (1.0,))[0] > 0
    assert main(["ngram", "list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["fingerprint"] == fp and len(rows[0]["sources"]) == 2


def test_cli_errors_are_one_line(stories260k, capsys) -> None:
    assert main(["ngram", "build", "/no/such/place", "-m", str(stories260k)]) != 0
    err = capsys.readouterr().err
    assert err.startswith("tandem: error: No such file") and "Traceback" not in err
    assert main(["ngram", "build", "-m", str(stories260k)]) != 0
