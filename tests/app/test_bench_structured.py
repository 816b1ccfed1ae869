"""`tandem bench --structured`: every Tandem configuration gives plain constrained
decoding's tokens, every reply is valid JSON, and the table says so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_structured_bench_runs_every_configuration_on_the_same_tokens(real_models, tmp_path: Path) -> None:
    out_json = tmp_path / "structured.json"
    result = subprocess.run(
        [sys.executable, "-m", "tandem.app.cli", "bench", "-m", str(real_models.smollm2), "--structured",
         "--prompts", "1", "--reps", "1", "--threads", "1", "--json", str(out_json)],
        capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr
    report = json.loads(out_json.read_text())
    rows = report["configs"]
    assert list(rows) == ["plain", "forced", "lookup+forced", "spec+forced", "llama-grammar"]
    for name in ("forced", "lookup+forced", "spec+forced"):
        assert rows[name]["identical_to_plain"] is True
        assert rows[name]["forced_tokens"] > 0 and rows[name]["target_calls"] < rows["plain"]["target_calls"]
    assert all(row["valid_json"] for row in rows.values())
    assert "| forced |" in result.stdout and "vs plain constrained" in result.stdout


def test_structured_bench_refuses_unknown_configurations(real_models) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tandem.app.cli", "bench", "-m", str(real_models.smollm2), "--structured",
         "--configs", "plain,warp"], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "Unknown configuration 'warp'" in result.stderr
