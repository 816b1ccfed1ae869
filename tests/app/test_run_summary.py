"""`tandem run` prints a llama.cpp-style summary on stderr (unless --quiet or --json)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tandem.app.commands.run import run_summary
from tandem.runtime.generate import GenerationStats


def _stats(**changes) -> GenerationStats:
    base = dict(prompt_tokens=5, generated_tokens=1, ttft_s=0.05, total_s=0.05, tokens_per_s=0.0, target_calls=1,
                tokens_per_call=1.0, drafted_tokens=0, accepted_tokens=0, acceptance_rate=None,
                finish_reason="length", memory_bytes=0)
    return GenerationStats(**{**base, **changes})


def test_summary_lines() -> None:
    (one,) = run_summary(_stats(), {"drafter": None})
    assert "generated 1" in one and "tok/s" not in one
    lines = run_summary(_stats(generated_tokens=40, tokens_per_s=31.5, target_calls=16, tokens_per_call=2.5,
                               drafted_tokens=30, accepted_tokens=24, acceptance_rate=0.8), {"drafter": "suffix"})
    assert "31.5 tok/s" in lines[0]
    assert "24/30 drafted tokens accepted (80.0 %)" in lines[1] and "2.50 tokens per target call" in lines[1]


def test_summary_says_when_the_drafter_model_was_never_loaded_or_failed_to() -> None:
    model = "suffix+lookup+model:qwen2.5-coder-0.5b"
    lines = run_summary(_stats(generated_tokens=8), {"drafter": model, "drafter_loaded": False})
    assert "nothing drafted" in lines[1] and "was not loaded" in lines[2]
    lines = run_summary(_stats(generated_tokens=8), {"drafter": model, "drafter_loaded": False,
                                                     "drafter_error": "The drafter x could not be loaded: gone"})
    assert lines[2] == "tandem: The drafter x could not be loaded: gone"
    assert len(run_summary(_stats(generated_tokens=8), {"drafter": model, "drafter_loaded": True})) == 2


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "tandem.app.cli", "run", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_run_prints_a_summary_on_stderr_unless_quiet_or_json(stories260k: Path) -> None:
    base = ["-m", str(stories260k), "-p", "Once upon a time", "-n", "12", "--threads", "1",
            "--draft-mode", "ngram", "--draft-len", "3"]
    r = _cli(*base)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("tandem: ")]
    assert "generated 12" in lines[0] and "tok/s decode" in lines[0]
    assert "tokens per target call" in lines[1] and "drafter" in lines[1]
    assert "tandem:" not in r.stdout
    quiet = _cli(*base, "--quiet")
    assert quiet.returncode == 0 and "tandem: " not in quiet.stderr and quiet.stdout == r.stdout
    as_json = _cli(*base, "--json")
    assert as_json.returncode == 0 and "tandem: " not in as_json.stderr
    assert json.loads(as_json.stdout)["stats"]["generated_tokens"] == 12


def test_a_new_models_timing_padding_is_not_called_failed_drafts(stories260k: Path) -> None:
    """A new target's first run pads drafts to time its verify calls: the summary says so
    instead of showing them as drafts that all failed, and the run after it, with the
    costs cached, pads nothing."""
    lines = run_summary(_stats(generated_tokens=12, target_calls=8, tokens_per_call=1.5, drafted_tokens=10,
                               accepted_tokens=2, acceptance_rate=0.2, timing_tokens=8), {"drafter": "suffix"})
    assert "2/10 drafted tokens accepted (20.0 %); 8 tokens of them padding that timed this model's" in lines[1]
    base = ["-m", str(stories260k), "-p", "Once upon a time", "-n", "24", "--threads", "1", "--json"]
    first = _cli(*base)
    assert first.returncode == 0, first.stderr
    stats = json.loads(first.stdout)["stats"]
    assert 0 < stats["timing_tokens"] <= stats["drafted_tokens"]
    again = _cli(*base)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["stats"]["timing_tokens"] == 0
    assert json.loads(again.stdout)["token_ids"] == json.loads(first.stdout)["token_ids"]
