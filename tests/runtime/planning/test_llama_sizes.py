"""llama.cpp's sizes of a model, asked of a child: answers stay put within a process."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.runtime.planning import llama_sizes
from tandem.runtime.planning.llama_sizes import ContextSetup


def test_a_later_child_does_not_move_the_runtime_heap(stories260k: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every plan ends its sizing children; a later plan asking a new setup starts another,
    which measures the runtime heap again. The first figure stays: a suggested budget
    computed from it once failed to fit when a second child measured a few KiB more (CI)."""
    monkeypatch.setattr(llama_sizes, "_MEMO", {})
    first = llama_sizes.LlamaSizes(stories260k, persist=False)
    runtime = first.runtime
    small = first.context(ContextSetup(256, 64))
    first.close()
    # Pretend the first child measured less than any child will: a re-measurement would show.
    llama_sizes._MEMO[first._cache_file.name]["runtime"] = runtime - 4096
    second = llama_sizes.LlamaSizes(stories260k, persist=False)
    larger = second.context(ContextSetup(512, 64))  # not cached: a new child answers it
    assert second._proc is not None
    second.close()
    assert second.runtime == runtime - 4096
    assert larger.compute >= small.compute


def test_a_child_started_early_answers_its_first_question(stories260k: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``start_soon`` spawns the child before anything is asked; the runtime line it prints
    first is read as the runtime, not as the answer to the first context question."""
    monkeypatch.setattr(llama_sizes, "_MEMO", {})
    sizes = llama_sizes.LlamaSizes(stories260k, persist=False)
    sizes.start_soon()
    answer = sizes.context(ContextSetup(256, 64))
    assert answer.compute > 0 and sizes.runtime > 0
    sizes.close()


def test_the_childs_end_of_generation_tokens_become_the_files_fact(stories260k: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The child passes over the vocabulary for them anyway: the model's load after the
    plan recalls them instead of passing again (a tenth of a second for 151k tokens)."""
    from tandem.runtime.backends import file_facts, llama_vocab
    from tandem.runtime.backends.llama_vocab import LlamaVocab

    monkeypatch.setattr(llama_sizes, "_MEMO", {})
    assert file_facts.recall(stories260k, file_facts.EOG_TOKENS) is None
    sizes = llama_sizes.LlamaSizes(stories260k)
    assert sizes.runtime > 0
    sizes.close()
    remembered = file_facts.recall(stories260k, file_facts.EOG_TOKENS)
    with monkeypatch.context() as m:  # the load's own pass, with nothing remembered
        m.setattr(file_facts, "recall", lambda *args: None)
        scanned = sorted(LlamaVocab.open(stories260k).special.eog)
    assert remembered == scanned and scanned

    def no_pass(*args: object) -> bool:
        raise AssertionError("the vocabulary was scanned again")

    monkeypatch.setattr(llama_vocab, "end_of_generation", no_pass)
    assert sorted(LlamaVocab.open(stories260k).special.eog) == scanned
