"""`tandem bench --autocomplete`: the target opened as users get it (through the engine
builder), every method measured for every k, the figures written as JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_autocomplete_bench_measures_every_method_on_the_engine_target(real_models, tmp_path: Path) -> None:
    out_json = tmp_path / "autocomplete.json"
    result = subprocess.run(
        [sys.executable, "-m", "tandem.app.cli", "bench", "-m", str(real_models.smollm2), "--autocomplete",
         "--k", "2", "-n", "4", "--prompts", "1", "--reps", "1", "--threads", "1", "--json", str(out_json)],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    report = json.loads(out_json.read_text())
    assert report["model"] == Path(real_models.smollm2).stem
    figures = report["k"]["2"]
    methods = {m: figures[m] for m in ("superposed", "sequential", "batched")}
    assert all(m["median_s"] > 0 and m["tokens"] > 0 for m in methods.values())
    assert figures["speedup_vs_sequential"] > 0 and figures["speedup_vs_batched"] > 0
    assert "superposed" in result.stdout
