"""Shared fixtures: the real models in ../shared/fixtures, and an isolated user home.

Outside CI a missing fixture skips the tests that need it, with the reason; under
``CI=true`` it fails them, because CI always has the fixtures.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(os.environ.get("TANDEM_FIXTURES", ROOT.parent / "shared" / "fixtures"))
IN_CI = os.environ.get("CI", "").lower() == "true"


def fixture_path(relative: str) -> Path:
    """A path inside the shared fixtures, or skip (fail under CI) if it is absent."""
    path = FIXTURES / relative
    if not path.exists():
        message = f"fixture {relative} not found under {FIXTURES} (see shared/fixtures/README.md)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(autouse=True)
def isolated_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own TANDEM_HOME, so nothing touches the real user data dirs."""
    home = tmp_path_factory.mktemp("tandem-home")
    monkeypatch.setenv("TANDEM_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("TANDEM_MODEL_PATH", raising=False)
    return home


@pytest.fixture(scope="session")
def stories260k() -> Path:
    return fixture_path("models/stories260K/stories260K.gguf")


@pytest.fixture(scope="session")
def tinystories656k_dir() -> Path:
    return fixture_path("models/tinystories-656k")


@pytest.fixture(scope="session")
def vocab_gguf() -> Path:
    return fixture_path("tokenizers/vocab-gguf")


@pytest.fixture()
def stories_backend(stories260k: Path):
    from tandem.runtime.llama_backend import LlamaConfig, LlamaCppBackend

    backend = LlamaCppBackend(stories260k, LlamaConfig(n_ctx=512))
    yield backend
    backend.close()
