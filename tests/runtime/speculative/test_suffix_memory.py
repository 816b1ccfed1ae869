"""The suffix tree kept across sessions (``SuffixMemory = "saved"``): what a user's
earlier chats held drafts a later session's repeat of it; a damaged or foreign file
never reaches the target as an id it does not have."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.speculative.drafters import suffix
from tandem.runtime.speculative.drafters.suffix import (
    GlobalSuffixCache,
    SuffixDrafter,
    SuffixParams,
)

GREEDY = Sampler(SamplingParams.greedy_params())
STORY = [10, 11, 12, 13, 14, 15, 16]


def _session(file: Path, n_vocab: int = 100) -> GlobalSuffixCache:
    cache = GlobalSuffixCache(file=file, n_vocab=n_vocab)
    assert cache.wait_loaded(timeout=60)
    return cache


def test_a_later_session_drafts_what_an_earlier_one_saw(tmp_path: Path) -> None:
    file = tmp_path / "tree.json"
    first = SuffixDrafter(global_cache=_session(file))
    first.propose(STORY, 4, GREEDY)
    first.close()  # ends the request and saves the session's sequences
    assert file.is_file()
    later = SuffixDrafter(global_cache=_session(file))
    assert later.propose([3, 10, 11, 12], 3, GREEDY).tokens == [13, 14, 15]
    assert SuffixDrafter(global_cache=_session(tmp_path / "other.json")).propose([3, 10, 11, 12], 3, GREEDY).tokens == []


def test_nothing_is_written_when_nothing_was_learnt(tmp_path: Path) -> None:
    file = tmp_path / "tree.json"
    cache = _session(file)
    SuffixDrafter(global_cache=cache).close()
    assert not cache.save() and not file.exists()


def test_a_damaged_or_foreign_file_starts_empty_and_is_replaced(tmp_path: Path) -> None:
    file = tmp_path / "tree.json"
    for text in ("{not json", json.dumps({"format": 99, "sequences": [STORY]}), json.dumps([STORY])):
        file.write_text(text)
        assert len(_session(file)) == 0
    file.write_text(json.dumps({"format": suffix.SAVED_FORMAT,
                                "sequences": [STORY, [1, 2, 100], [1, -2], [1, True], [1, 2.5], "x"]}))
    cache = _session(file, n_vocab=100)
    assert [list(s) for s in cache._seqs] == [STORY]  # ids outside the vocabulary are left out
    SuffixDrafter(global_cache=cache).propose([50, 51, 52], 2, GREEDY)
    cache.add([50, 51, 52])
    assert cache.save()
    assert json.loads(file.read_text())["sequences"] == [STORY, [50, 51, 52]]


def test_requests_finished_while_the_file_loads_are_kept_after_it(tmp_path: Path, monkeypatch) -> None:
    """Loading runs on a thread so the first token never waits for it; what this
    session adds meanwhile stays, and is newer (evicted later) than the saved text."""
    file = tmp_path / "tree.json"
    file.write_text(json.dumps({"format": suffix.SAVED_FORMAT, "sequences": [STORY]}))
    release = threading.Event()
    read = suffix.read_sequences

    def slow_read(path: Path, n_vocab: int) -> list[list[int]]:
        assert release.wait(timeout=60)
        return read(path, n_vocab)

    monkeypatch.setattr(suffix, "read_sequences", slow_read)
    cache = GlobalSuffixCache(SuffixParams(max_cached_requests=2), file=file, n_vocab=100)
    drafter = SuffixDrafter(global_cache=cache)
    assert drafter.propose([3, 10, 11, 12], 3, GREEDY).tokens == []  # not loaded yet: no wait
    cache.add([20, 21, 22])
    cache.add([30, 31, 32])
    release.set()
    assert cache.wait_loaded(timeout=60)
    assert [list(s) for s in cache._seqs] == [[20, 21, 22], [30, 31, 32]]  # FIFO: the oldest (saved) went first
    assert drafter.propose([5, 30, 31], 1, GREEDY).tokens == [32]
