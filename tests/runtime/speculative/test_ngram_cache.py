"""The OmniDraft n-gram cache: longest match, determinism, eviction, persistence."""

from __future__ import annotations

import json

from tandem.models import paths
from tandem.runtime.speculative.drafters.xvocab.translation_cache import (
    NGramCache,
    default_cache_path,
    vocab_fingerprint,
)


def test_longest_match_prefers_longer_entries() -> None:
    cache = NGramCache()
    cache.add([1, 2], [10])
    cache.add([1, 2, 3], [11])
    assert cache.longest_match([0, 1, 2, 3, 4], 1) == (3, (11,))
    assert cache.longest_match([1, 2, 9], 0) == (2, (10,))
    assert cache.longest_match([1, 9], 0) is None
    assert cache.longest_match([5, 1, 2], 1) == (2, (10,))
    assert cache.has_path([1]) and cache.has_path([1, 2, 3]) and not cache.has_path([2])


def test_first_mapping_wins_and_bad_entries_are_refused() -> None:
    cache = NGramCache(max_draft_len=4)
    assert cache.add([1, 2], [10])
    assert not cache.add([1, 2], [99])  # deterministic: keeps the first target
    assert cache.get([1, 2]) == (10,)
    assert not cache.add([3], [4, 5])  # more target ids than drafter ids: m <= k breaks
    assert not cache.add([1, 2, 3, 4, 5], [6])  # longer than max_draft_len
    assert not cache.add([], [1])
    assert len(cache) == 1


def test_eviction_keeps_frequent_entries() -> None:
    cache = NGramCache(capacity=10)
    cache.add([100, 101], [7])
    for _ in range(5):
        cache.longest_match([100, 101], 0)  # make it valuable
    for i in range(20):
        cache.add([i, i + 1, 500], [i])
    assert len(cache) <= 10
    assert cache.get([100, 101]) == (7,)
    # Evicted paths are gone from the trie too.
    for key, target in cache.items():
        assert cache.longest_match(list(key), 0) == (len(key), target)
    assert sum(cache.has_path([i]) for i in range(20)) == len(cache) - 1


def test_save_load_round_trip(tmp_path) -> None:
    cache = NGramCache()
    cache.add([1, 2], [10])
    cache.add([3, 4, 5], [11, 12])
    path = tmp_path / "sub" / "cache.json"
    cache.save(path)
    loaded = NGramCache.load(path)
    assert sorted(loaded.items()) == sorted(cache.items())
    assert not list(path.parent.glob("*.tmp"))


def test_missing_or_corrupt_file_gives_an_empty_cache(tmp_path) -> None:
    assert len(NGramCache.load(tmp_path / "nope.json")) == 0
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert len(NGramCache.load(bad)) == 0
    bad.write_text(json.dumps({"version": 999, "entries": [[[1, 2], [3], 1]]}))
    assert len(NGramCache.load(bad)) == 0
    bad.write_text(json.dumps({"version": 1, "entries": [[[1, 2], [3], 1], "junk", [[1], [2, 3], 1]]}))
    assert NGramCache.load(bad).items() == [((1, 2), (3,))]


def test_cache_path_is_per_tokenizer_pair_in_the_data_dir() -> None:
    a = vocab_fingerprint([b"a", b"b"])
    b = vocab_fingerprint([b"a", b"c"])
    assert a != b and a == vocab_fingerprint([b"a", b"b"])
    path = default_cache_path(a, b)
    assert path.parent.parent == paths.data_dir()
    assert default_cache_path(b, a) != path
