"""Shared fixtures: the real models in ../shared/fixtures, and an isolated user home.

Outside CI a missing fixture skips the tests that need it, with the reason; under
``CI=true`` it fails them, because CI always has the fixtures.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from extras_skip import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401 (hooks)

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


@dataclass(frozen=True)
class RealModels:
    """The three real instruction-tuned GGUF models of ``shared/fixtures/real-models.sh``."""

    smollm2: Path  # SmolLM2-135M-Instruct Q4_1, vocab 49,152: the cross-vocabulary drafter
    qwen_05b: Path  # Qwen2.5-Coder-0.5B-Instruct Q4: FIM model, same-vocabulary drafter
    qwen_15b: Path  # Qwen2.5-Coder-1.5B-Instruct Q4_K_M: the realistic target


def fetch_real_models() -> RealModels:
    """Run the fetch script (cached and sha256-checked; ~20 s the first time on a machine)."""
    script = FIXTURES / "real-models.sh"
    if not script.exists():
        raise FileNotFoundError(f"{script} not found (see shared/fixtures/README.md)")
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"real-models.sh failed: {done.stderr.strip()[-2000:]}")
    paths = dict(line.split("\t", 1) for line in done.stdout.splitlines() if "\t" in line)
    return RealModels(
        smollm2=Path(paths["smollm2-135m-instruct"]),
        qwen_05b=Path(paths["qwen2.5-coder-0.5b"]),
        qwen_15b=Path(paths["qwen2.5-coder-1.5b"]),
    )


@pytest.fixture(scope="session")
def real_models() -> RealModels:
    """The real models; fetched under ``CI=true`` (a failure fails), skipped elsewhere if
    they cannot be had (no network, no shared fixtures)."""
    try:
        return fetch_real_models()
    except (OSError, RuntimeError, KeyError, subprocess.TimeoutExpired) as exc:
        if IN_CI:
            pytest.fail(f"real models could not be fetched: {exc}")
        pytest.skip(f"real models not available: {exc}")


@pytest.fixture(autouse=True)
def isolated_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own TANDEM_HOME, so nothing touches the real user data dirs."""
    home = tmp_path_factory.mktemp("tandem-home")
    monkeypatch.setenv("TANDEM_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("TANDEM_MODEL_PATH", raising=False)
    monkeypatch.setenv("TANDEM_KERNEL_PROBE", "off")  # no background measurement outliving a test
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
    from tandem.runtime.backends.llama import LlamaCppBackend
    from tandem.runtime.backends.llama_config import LlamaConfig

    backend = LlamaCppBackend(stories260k, LlamaConfig(n_ctx=512))
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def tinystories656k_gguf(tinystories656k_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 656k checkpoint converted to an F32 GGUF (once per test session)."""
    from tandem.models.convert import convert_hf

    out = tmp_path_factory.mktemp("converted") / "tinystories-656k-f32.gguf"
    return convert_hf(tinystories656k_dir, out, "f32")


@pytest.fixture(scope="session")
def small_twin(tinystories656k_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An F32 cost twin of the converted 656k model: hidden 256, 4 layers, ~3.7M parameters."""
    from tandem.models.twin import build_twin

    out = tmp_path_factory.mktemp("twins") / "tinystories-656k-twin-4M-f32.gguf"
    return build_twin(tinystories656k_gguf, out, "4M", "f32").path


@pytest.fixture(scope="session")
def hf_tokenizers() -> Path:
    """Folder of real Hugging Face tokenizer.json files (phi-2, phi-3-mini)."""
    return fixture_path("tokenizers/hf")


@pytest.fixture(scope="session")
def stories_twin(stories260k: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Q8_0 cost twin of stories260K (~8M parameters): same vocabulary and the same
    function, so stories260K drafts for it with full acceptance (planner and split tests)."""
    from tandem.models.twin import ensure_twin

    return ensure_twin(stories260k, "8M", "q8_0", tmp_path_factory.mktemp("stories-twin"))


@pytest.fixture(scope="session")
def stories_moe(stories260k: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """stories260K MoEfied into 8 experts per layer, top-2, routers calibrated on its own samples."""
    from tandem.app.commands.moefy import moefy_file

    out = tmp_path_factory.mktemp("moefy") / "stories260K-moe8x2.gguf"
    return moefy_file(stories260k, out, 8, 2, n_tokens=400).path
