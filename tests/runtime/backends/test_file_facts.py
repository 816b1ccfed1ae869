"""A model file's facts (finite logits, byte coverage, end-of-generation tokens) are found
on its first load and remembered per file version; a changed file is checked again."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tandem.runtime.backends import file_facts, opener
from tandem.runtime.backends.llama import LlamaConfig
from tandem.runtime.backends.opener import open_backend


@pytest.fixture()
def counted_checks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    real = opener.check_finite_logits

    def counted(backend) -> None:
        calls.append(backend.name)
        real(backend)

    monkeypatch.setattr(opener, "check_finite_logits", counted)
    return calls


def test_second_load_reuses_what_the_first_found(stories260k: Path, tmp_path: Path, counted_checks: list[str]) -> None:
    model = tmp_path / "stories.gguf"
    shutil.copy(stories260k, model)
    config = LlamaConfig(n_ctx=64, n_threads=1)
    with open_backend(model, llama_config=config) as first:
        special, ids = first.special, first.tokenize("Once upon a time")
    assert counted_checks == ["stories"]
    assert file_facts.recall(model, "end-of-generation tokens") == sorted(special.eog)
    assert file_facts.recall(model, "covers every byte") is True
    with open_backend(model, llama_config=config) as second:
        assert second.special == special and second.tokenize("Once upon a time") == ids
    assert counted_checks == ["stories"]  # not checked again
    with open_backend(model, llama_config=LlamaConfig(n_ctx=64, n_threads=1, repack=True)):
        pass
    assert counted_checks == ["stories"] * 2  # other kernels: checked once for them too
    os.utime(model, ns=(os.stat(model).st_atime_ns, os.stat(model).st_mtime_ns + 10**9))
    with open_backend(model, llama_config=config):
        pass
    assert counted_checks == ["stories"] * 3  # a new version of the file


def test_facts_are_kept_per_file_and_survive_a_damaged_cache(stories260k: Path, tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    shutil.copy(stories260k, model)
    assert file_facts.recall(model, "x") is None
    file_facts.remember(model, "x", [1, 2])
    file_facts.remember(model, "y", True)
    assert file_facts.recall(model, "x") == [1, 2] and file_facts.recall(model, "y") is True
    path = file_facts.facts_path(model)
    assert path is not None
    path.write_text("{not json")
    assert file_facts.recall(model, "x") is None  # damaged: found again, never an error
    assert file_facts.facts_path(tmp_path / "missing.gguf") is None
