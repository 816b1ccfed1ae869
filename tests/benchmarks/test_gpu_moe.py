"""benchmarks/gpu_moe.py on this CPU build, with the tiny MoE: every placement loads, the
overrides llama.cpp reports are counted, and greedy output is compared."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_moe import N_LAYER, write_tiny_moe

from benchmarks.gpu_moe import main


def test_three_placements_measured_and_compared(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = write_tiny_moe(tmp_path / "tiny-moe.gguf")
    out = tmp_path / "out"
    assert main([str(model), "--vram", "1GiB", "--out", str(out), "--tokens", "4", "--rounds", "2",
                 "--home", "2"]) == 0
    result = json.loads((out / "gpu_moe.json").read_text())
    loads = result["loads"]
    assert loads["cpu"]["overridden_tensors"] == 0
    assert loads["exps=CPU"]["overridden_tensors"] == 3 * N_LAYER
    assert loads["planned"]["overridden_tensors"] == 3 * 2
    assert result["plan"]["overridden_by_home"] == 2 and "n_gpu_layers" in result["plan"]
    for name in ("cpu", "exps=CPU", "planned"):
        speed = result["decode_tok_s"][name]
        assert len(speed["all"]) == 2 and speed["median"] > 0
    assert result["greedy_planned_vs_cpu"] == {"equal": True, "tokens": 16}
    printed = capsys.readouterr().out
    assert "exps=CPU" in printed and "greedy planned vs cpu: equal" in printed
    assert "buffer type overridden to CPU" in (out / "llama.log").read_text()


def test_dense_model_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dense = write_tiny_moe(tmp_path / "dense.gguf", n_expert=0)
    assert main([str(dense), "--vram", "1GiB", "--out", str(tmp_path / "out")]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "gpu_moe: error:" in line]
    assert len(err) == 1 and "not a mixture-of-experts GGUF" in err[0]


def test_no_round_starts_after_the_time_budget(tmp_path: Path) -> None:
    model = write_tiny_moe(tmp_path / "tiny-moe.gguf")
    out = tmp_path / "out"
    assert main([str(model), "--vram", "1GiB", "--out", str(out), "--tokens", "2", "--rounds", "5",
                 "--time-budget", "0"]) == 0
    result = json.loads((out / "gpu_moe.json").read_text())
    assert result["rounds_run"] == 1
    assert all(len(s["all"]) == 1 for s in result["decode_tok_s"].values())
