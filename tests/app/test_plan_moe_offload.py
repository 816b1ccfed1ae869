"""``tandem plan --moe-offload`` on a MoE GGUF: which layers' experts stay in host memory,
shown as a line of the plan, without the torch extra."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_moe import N_LAYER, write_tiny_moe

from tandem.runtime.planning.devices import SAFETY
from tandem.runtime.planning.memory_model import Setup, estimate
from tandem.runtime.planning.shapes import shape_from_gguf

BLOCKER = Path(__file__).resolve().parents[1] / "without_extras"


def tandem_without_extras(home: Path, *args: str) -> subprocess.CompletedProcess:
    """The CLI with torch, onnxruntime... hidden (tests/without_extras)."""
    env = dict(os.environ, TANDEM_HOME=str(home), HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(BLOCKER), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, "-m", "tandem.app.cli", *args], env=env, capture_output=True,
                          text=True, timeout=180, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_moe(tmp_path_factory.mktemp("moe") / "tiny-moe.gguf")


def test_plan_shows_the_layers_whose_experts_stay_home(tiny_moe: Path, isolated_home: Path) -> None:
    shape = shape_from_gguf(tiny_moe)
    # the GPU bytes with n layers' experts at home, as the planner prices a 128-token context
    need = [int(estimate(shape, Setup(136, n_gpu_layers=-1, output_rows=9, host_expert_layers=n)).gpu
                / (1 - SAFETY)) + 4096 for n in range(N_LAYER + 1)]
    for n in (1, 2, N_LAYER):
        r = tandem_without_extras(isolated_home, "plan", "-m", str(tiny_moe), "--profile", "rtx3060-laptop",
                                  "--vram", str(need[n]), "--ctx", "128", "--moe-offload")
        assert r.returncode == 0, r.stderr
        assert "gpu layers -1" in r.stdout
        assert f"experts of {n}/{N_LAYER} layers in host memory" in r.stdout, r.stdout
    r = tandem_without_extras(isolated_home, "plan", "-m", str(tiny_moe), "--profile", "rtx3060-laptop",
                              "--vram", str(need[0]), "--ctx", "128", "--moe-offload")
    assert r.returncode == 0 and "layers in host memory" not in r.stdout


def test_dense_gguf_and_torch_budget_are_refused_in_one_line(tiny_moe: Path, tmp_path: Path,
                                                             isolated_home: Path) -> None:
    dense = write_tiny_moe(tmp_path / "dense.gguf", n_expert=0)
    for args, needle in (([str(dense), "--moe-offload"], "not a mixture-of-experts GGUF"),
                         ([str(tiny_moe), "--moe-offload", "2GiB"], "add --engine torch")):
        r = tandem_without_extras(isolated_home, "plan", "-m", *args, "--profile", "rtx3060-laptop",
                                  "--vram", "1GiB")
        assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
        (line,) = r.stderr.strip().splitlines()
        assert line.startswith("tandem: error:") and needle in line, line
