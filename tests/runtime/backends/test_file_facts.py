"""A model file's facts (finite logits, byte coverage, end-of-generation tokens) are found
on its first load and remembered per file version; a changed file is checked again."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from tandem.errors import ModelFormatError
from tandem.runtime.backends import file_facts
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_config import LlamaConfig
from tandem.runtime.backends.opener import open_backend


@pytest.fixture()
def counted_checks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the models asked to check their first logits."""
    calls: list[str] = []
    real = LlamaCppBackend.check_first_logits

    def counted(backend, on_finite) -> None:
        calls.append(backend.name)
        real(backend, on_finite)

    monkeypatch.setattr(LlamaCppBackend, "check_first_logits", counted)
    return calls


def test_second_load_reuses_what_the_first_found(stories260k: Path, tmp_path: Path, counted_checks: list[str]) -> None:
    model = tmp_path / "stories.gguf"
    shutil.copy(stories260k, model)
    config = LlamaConfig(n_ctx=64, n_threads=1)
    with open_backend(model, llama_config=config) as first:
        special, ids = first.special, first.tokenize("Once upon a time")
        first.evaluate(ids)  # the first logits: checked, found finite, remembered
    assert counted_checks == ["stories"]
    assert file_facts.recall(model, "end-of-generation tokens") == sorted(special.eog)
    assert file_facts.recall(model, "covers every byte") is True
    with open_backend(model, llama_config=config) as second:
        assert second.special == special and second.tokenize("Once upon a time") == ids
    assert counted_checks == ["stories"]  # not checked again
    with open_backend(model, llama_config=LlamaConfig(n_ctx=64, n_threads=1, repack=True)) as repacked:
        repacked.evaluate(ids)
    assert counted_checks == ["stories"] * 2  # other kernels: checked once for them too
    os.utime(model, ns=(os.stat(model).st_atime_ns, os.stat(model).st_mtime_ns + 10**9))
    with open_backend(model, llama_config=config):
        pass
    assert counted_checks == ["stories"] * 3  # a new version of the file
    with open_backend(model, llama_config=config):
        pass
    assert counted_checks == ["stories"] * 4  # never evaluated, so not known finite yet


def test_non_finite_first_logits_are_refused_until_finite_ones_come(stories260k: Path, tmp_path: Path) -> None:
    """The check reads a real call's logits: NaN or infinite ones raise a clear error (and
    keep the check armed); finite ones end it, and the file is remembered as sound."""
    model = tmp_path / "stories.gguf"
    shutil.copy(stories260k, model)
    with open_backend(model, llama_config=LlamaConfig(n_ctx=64, n_threads=1)) as backend:
        assert isinstance(backend, LlamaCppBackend)
        bad = np.zeros((2, backend.n_vocab), dtype=np.float32)
        bad[1, 7] = np.nan
        with pytest.raises(ModelFormatError, match="NaN or infinite"):
            backend.checked_logits(bad)
        bad[1, 7] = np.inf
        with pytest.raises(ModelFormatError, match="NaN or infinite"):
            backend.checked_logits(bad)
        assert not any(file_facts.recall(model, f) for f in _finite_facts(model))
        logits = backend.evaluate(backend.tokenize("Once upon a time"))
        assert np.isfinite(logits).all()
        assert any(file_facts.recall(model, f) for f in _finite_facts(model))
        bad[1, 7] = np.nan
        assert backend.checked_logits(bad) is bad  # checked once: later calls pass through


def _finite_facts(model: Path) -> list[str]:
    import json

    path = file_facts.facts_path(model)
    if path is None or not path.exists():
        return []
    return [f for f in json.loads(path.read_text()) if f.startswith("finite logits|")]


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
