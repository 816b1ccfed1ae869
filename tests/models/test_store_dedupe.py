"""The model store lists each file once however it is reached, and a name that matches
several different files is an error that lists them instead of a silent pick."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.errors import ModelNotFound
from tandem.models.store import list_models, resolve_model


def test_nested_search_folders_links_and_hard_links_list_a_file_once(tmp_path: Path, monkeypatch,
                                                                       stories260k: Path) -> None:
    outer = tmp_path / "models"
    inner = outer / "tiny"
    inner.mkdir(parents=True)
    shutil.copy(stories260k, inner / "tiny.gguf")
    os.link(inner / "tiny.gguf", outer / "hard-link.gguf")  # same file, another name
    (tmp_path / "alias").symlink_to(inner)
    relative = os.path.relpath(inner, Path.cwd())
    monkeypatch.setenv("TANDEM_MODEL_PATH", os.pathsep.join([str(outer), str(inner), str(tmp_path / "alias"),
                                                             relative]))
    entries = list_models()
    assert len(entries) == 1 and entries[0].path.name in ("tiny.gguf", "hard-link.gguf")


def test_a_name_matching_two_different_files_is_an_error_listing_both(tmp_path: Path, monkeypatch,
                                                                       stories260k: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    shutil.copy(stories260k, a / "same.gguf")
    shutil.copy(stories260k, b / "same.gguf")  # equal bytes, but two files
    monkeypatch.setenv("TANDEM_MODEL_PATH", os.pathsep.join([str(a), str(b)]))
    with pytest.raises(ModelNotFound) as err:
        resolve_model("same")
    assert str(a / "same.gguf") in str(err.value) and str(b / "same.gguf") in str(err.value)
    assert resolve_model(str(b / "same.gguf")) == b / "same.gguf"  # a path is never ambiguous


def test_cli_ambiguous_name_is_one_clear_error(tmp_path: Path, stories260k: Path) -> None:
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        shutil.copy(stories260k, tmp_path / d / "same.gguf")
    env = {**os.environ, "TANDEM_MODEL_PATH": os.pathsep.join([str(tmp_path / "a"), str(tmp_path / "b")])}
    r = subprocess.run([sys.executable, "-m", "tandem.app.cli", "run", "-m", "same", "-p", "hi", "-n", "1"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "names 2 different files" in r.stderr and str(tmp_path / "b" / "same.gguf") in r.stderr
