"""The local model store and `pull`, against a seeded local hub cache (never the network)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.errors import ModelNotFound, OfflineError, TandemError
from tandem.models.hub import pull
from tandem.models.paths import models_dir
from tandem.models.store import list_models, remove_model, resolve_model, store_entry

REPO = "tandem-test/stories"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def seed_hub_cache(cache: Path, src: Path, filename: str, commit: str = COMMIT) -> Path:
    """Lay out a file the way huggingface-hub stores a download (blob + snapshot link)."""
    repo_dir = cache / f"models--{REPO.replace('/', '--')}"
    data = src.read_bytes()
    blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    snap = repo_dir / "snapshots" / commit / filename
    snap.parent.mkdir(parents=True, exist_ok=True)
    snap.symlink_to(os.path.relpath(blob, snap.parent))
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / "main").write_text(commit)
    return snap


@pytest.fixture()
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stories260k: Path) -> Path:
    cache = tmp_path / "hub"
    seed_hub_cache(cache, stories260k, "stories260K.gguf")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    return cache


def test_store_lists_local_and_extra_folders(tmp_path: Path, monkeypatch, stories260k: Path) -> None:
    shutil.copy(stories260k, models_dir() / "mine.gguf")
    extra = tmp_path / "extra"
    extra.mkdir()
    shutil.copy(stories260k, extra / "other.gguf")
    monkeypatch.setenv("TANDEM_MODEL_PATH", str(extra))
    names = {m.name: m for m in list_models()}
    assert {"mine", "other"} <= set(names)
    assert names["mine"].architecture == "llama" and names["other"].source == "path"
    assert resolve_model("other") == extra / "other.gguf"
    with pytest.raises(ModelNotFound, match="not in the store"):
        resolve_model("nothing-like-this")


def test_pull_offline_uses_the_hub_cache(hub_cache: Path) -> None:
    path = pull(REPO, "stories260K.gguf")
    assert path.name == "stories260K.gguf" and path.exists()
    assert any(m.name == f"{REPO}/stories260K.gguf" for m in list_models())
    assert resolve_model(f"{REPO}/stories260K.gguf") == path


def test_pull_offline_missing_file_is_a_clear_error(hub_cache: Path) -> None:
    with pytest.raises(OfflineError, match="not in the local cache"):
        pull(REPO, "missing.gguf")
    assert pull(REPO) == pull(REPO, "stories260K.gguf")  # the only GGUF cached of the repository
    with pytest.raises(OfflineError, match="name the file"):
        pull("tandem-test/not-cached")


def test_pull_cli_offline_exits_cleanly(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "empty-hub")}
    r = subprocess.run(
        [sys.executable, "-m", "tandem.app.cli", "pull", "someone/model", "model.gguf"],
        capture_output=True, text=True, timeout=60, env=env,
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "offline" in r.stderr.lower()


def test_cache_files_are_replaced_whole_or_not_at_all(tmp_path, monkeypatch) -> None:
    """A measurement cache is written to a temporary file and renamed over the old one: a
    failure before the rename (a full disk, a kill) leaves the old content and no litter."""
    from pathlib import Path

    from tandem.models.paths import write_cache_file

    target = tmp_path / "sub" / "costs.json"
    assert write_cache_file(target, '{"a": 1}') and target.read_text() == '{"a": 1}'

    def refuse(self, other):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "replace", refuse)
    assert write_cache_file(target, '{"a": 2}') is False
    assert target.read_text() == '{"a": 1}' and sorted(p.name for p in target.parent.iterdir()) == ["costs.json"]


def test_rm_deletes_a_pulled_file_with_its_data(hub_cache: Path, stories260k: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.gguf"
    other.write_bytes(stories260k.read_bytes() + b"\0" * 64)  # other bytes: its own blob
    seed_hub_cache(hub_cache, other, "second.gguf")  # a second file of the same revision
    newer = seed_hub_cache(hub_cache, stories260k, "stories260K.gguf", commit="f" * 40)  # same data, newer revision
    blobs = hub_cache / f"models--{REPO.replace('/', '--')}" / "blobs"
    assert len(list(blobs.iterdir())) == 2
    assert sorted(e.name for e in list_models()) == [f"{REPO}/second.gguf", f"{REPO}/stories260K.gguf"]

    # one model, listed once, held by two revisions: it goes from both, with its data
    assert remove_model(store_entry(f"{REPO}/stories260K.gguf")) == stories260k.stat().st_size
    assert not newer.exists() and not newer.parent.exists() and len(list(blobs.iterdir())) == 1
    assert [e.name for e in list_models()] == [f"{REPO}/second.gguf"]  # the revision's other file stays
    assert resolve_model(f"{REPO}/second.gguf").read_bytes() == other.read_bytes()
    with pytest.raises(ModelNotFound):
        store_entry(f"{REPO}/stories260K.gguf")
    remove_model(store_entry(f"{REPO}/second.gguf"))  # the last file: the repository's folder goes
    assert not (hub_cache / f"models--{REPO.replace('/', '--')}").exists() and list_models() == []


def test_rm_deletes_a_local_file_but_never_a_model_path_folders(tmp_path: Path, monkeypatch,
                                                                stories260k: Path) -> None:
    mine = models_dir() / "mine.gguf"
    shutil.copy(stories260k, mine)
    extra = tmp_path / "extra"
    extra.mkdir()
    shutil.copy(stories260k, extra / "theirs.gguf")
    monkeypatch.setenv("TANDEM_MODEL_PATH", str(extra))
    assert remove_model(store_entry("mine")) == stories260k.stat().st_size and not mine.exists()
    with pytest.raises(TandemError, match="TANDEM_MODEL_PATH"):
        remove_model(store_entry("theirs"))
    assert (extra / "theirs.gguf").exists()
    with pytest.raises(ModelNotFound, match="not in the store"):
        store_entry(str(stories260k))  # a file, but not one the store lists


def test_a_model_runs_by_the_reference_it_was_pulled_with(hub_cache: Path, stories260k: Path, tmp_path: Path) -> None:
    """`run -m owner/name:Q8_0` finds the cached file `pull owner/name:Q8_0` fetched, with
    no network; a repository of one cached file answers to its bare name too."""
    assert resolve_model(f"hf.co/{REPO}") == resolve_model(f"{REPO}/stories260K.gguf")
    other = tmp_path / "other.gguf"
    other.write_bytes(stories260k.read_bytes() + b"\0" * 64)
    q8 = seed_hub_cache(hub_cache, other, "stories-Q8_0.gguf")
    assert resolve_model(f"{REPO}:q8_0").resolve() == q8.resolve()
    assert resolve_model(f"https://huggingface.co/{REPO}/blob/main/stories-Q8_0.gguf").resolve() == q8.resolve()
    with pytest.raises(TandemError, match="pick one") as several:  # two cached, no tag, no Q4_K_M
        resolve_model(REPO)
    assert "stories260K.gguf" in str(several.value) and "stories-Q8_0.gguf" in str(several.value)
    with pytest.raises(ModelNotFound, match=r"Pull it with `tandem pull someone/else:Q4_K_M`"):
        resolve_model("someone/else:Q4_K_M")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub_cache)}
    run = subprocess.run([sys.executable, "-m", "tandem.app.cli", "run", "-m", f"{REPO}:Q8_0", "-p", "Once upon a time",
                          "-n", "4", "--threads", "1", "--json"], capture_output=True, text=True, timeout=180, env=env)
    assert run.returncode == 0, run.stderr
    assert len(json.loads(run.stdout)["token_ids"]) == 4
