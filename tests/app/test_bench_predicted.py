"""`tandem bench --predicted`: every Tandem configuration gives plain decoding's tokens,
a prediction drafted whatever it costs is mostly accepted on an edit, and the table says so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_predicted_bench_runs_every_configuration_on_the_same_tokens(real_models, tmp_path: Path) -> None:
    out_json = tmp_path / "predicted.json"
    result = subprocess.run(
        [sys.executable, "-m", "tandem.app.cli", "bench", "-m", str(real_models.smollm2), "--predicted",
         "--prompts", "1", "--reps", "1", "-n", "48", "--threads", "1", "--json", str(out_json)],
        capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr
    report = json.loads(out_json.read_text())
    rows = report["configs"]
    assert list(rows) == ["plain", "auto", "auto+prediction", "prediction@8", "llama", "llama-lookup"]
    for name in ("auto", "auto+prediction", "prediction@8"):
        assert rows[name]["identical_to_plain"] is True
    fixed = rows["prediction@8"]  # drafted every round: what the prediction offers
    assert fixed["accepted"] > rows["plain"]["tokens"] / 3 and fixed["target_calls"] < rows["plain"]["target_calls"]
    assert "| auto+prediction |" in result.stdout and "vs plain" in result.stdout


def test_predicted_bench_refuses_unknown_configurations(real_models) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tandem.app.cli", "bench", "-m", str(real_models.smollm2), "--predicted",
         "--configs", "plain,warp"], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "Unknown configuration 'warp'" in result.stderr
