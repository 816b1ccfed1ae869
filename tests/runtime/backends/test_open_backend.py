"""Every front end takes any model kind: GGUF, an ONNX export, a Hugging Face folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.runtime.backends.opener import backend_kind, open_backend


@pytest.fixture(scope="module")
def stories_onnx(stories260k: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tandem.runtime.backends.onnx_export import export_onnx

    out = tmp_path_factory.mktemp("onnx") / "stories260K-onnx"
    export_onnx(stories260k, out)
    return out


def tandem_json(*args: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "tandem.app.cli", "run", *args, "--json", "--threads", "1"],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_kinds(stories260k: Path, stories_onnx: Path, tinystories656k_dir: Path) -> None:
    assert backend_kind(stories260k) == "gguf"
    assert backend_kind(stories_onnx) == "onnx"
    assert backend_kind(tinystories656k_dir) == "torch"
    with open_backend(stories_onnx, n_ctx=128) as b:
        assert type(b).__name__ == "OnnxBackend" and b.n_ctx == 128


def test_run_on_onnx_target_with_gguf_drafter_is_lossless(stories260k: Path, stories_onnx: Path) -> None:
    args = ("-p", "Once upon a time", "-n", "24", "--ctx", "256")
    plain = tandem_json("-m", str(stories260k), *args)
    onnx = tandem_json("-m", str(stories_onnx), *args)
    spec = tandem_json("-m", str(stories_onnx), "--draft", str(stories260k), "--draft-mode", "model",
                       "--draft-len", "3", *args)
    assert onnx["token_ids"] == plain["token_ids"] == spec["token_ids"]
    assert spec["stats"]["tokens_per_call"] > 1.5


def test_run_on_a_hugging_face_folder(tinystories656k_dir: Path) -> None:
    out = tandem_json("-m", str(tinystories656k_dir), "-p", "Once upon a time", "-n", "8")
    assert out["stats"]["generated_tokens"] == 8 and out["text"]


def test_chat_and_server_engines_open_onnx_targets(stories260k: Path, stories_onnx: Path) -> None:
    from tandem.app.server.loaded_models import load_model
    from tandem.app.tui.model_choice import ModelChoice, load_engine
    from tandem.kernels.sampling_params import SamplingParams
    from tandem.runtime.engine.spec import EngineSpec
    from tandem.runtime.generate import DoneEvent

    messages = [{"role": "user", "content": "Once upon a time"}]
    greedy = SamplingParams.greedy_params()

    def reply(engine) -> list[int]:
        return [e for e in engine.stream(messages, greedy, 16) if isinstance(e, DoneEvent)][0].tokens

    engine = load_engine(ModelChoice(EngineSpec(stories260k, n_ctx=256, threads=1, measure_cost=False)))
    try:
        expected = reply(engine)
    finally:
        engine.close()
    engine = load_engine(ModelChoice(EngineSpec(stories_onnx, stories260k, draft_mode="model", n_ctx=256, threads=1,
                                                measure_cost=False)))
    try:
        assert type(engine.target).__name__ == "OnnxBackend" and engine.drafter is not None
        assert reply(engine) == expected
    finally:
        engine.close()
    slot = load_model(EngineSpec(stories_onnx, n_ctx=256, threads=1))
    try:
        assert reply(slot.engine) == expected
    finally:
        slot.close()


@pytest.mark.parametrize("kind", ["onnx", "hf"])
def test_budget_is_checked_for_onnx_and_hf_targets(kind: str, stories_onnx: Path, tinystories656k_dir: Path) -> None:
    """A budget too small for the target refuses before loading with one error line and
    the BudgetError exit code; a roomy one still runs (issue #7: never over the budget)."""
    model = str(stories_onnx if kind == "onnx" else tinystories656k_dir)
    base = [sys.executable, "-m", "tandem.app.cli", "run", "-m", model, "-p", "Once", "-n", "4", "--threads", "1",
            "--ctx", "512"]
    r = subprocess.run([*base, "--budget", "20MiB"], capture_output=True, text=True, timeout=300, env=dict(os.environ))
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode != 0
    assert len(lines) == 1 and lines[0].startswith("tandem: error:"), r.stderr
    assert "What would fit" in lines[0]
    ok = subprocess.run([*base, "--budget", "8GiB"], capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert ok.returncode == 0, ok.stderr
