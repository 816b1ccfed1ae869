"""packaging/cuda_flags.sh: CUDA flags for llama.cpp where an NVIDIA GPU and a toolkit are,
checked with stand-in ``nvidia-smi`` and ``nvcc`` on PATH (and the bootstrap's use of it)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "packaging" / "cuda_flags.sh"


def _fake(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


def _run(tmp_path: Path, *, gpus: list[str] | None = None, nvcc: bool = False, env: dict | None = None):
    """The script with only the stand-ins (and basic tools) to find: ``gpus`` are the
    compute capabilities nvidia-smi reports (None: no nvidia-smi)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if gpus is not None:
        lines = "\\n".join(gpus)
        _fake(bin_dir, "nvidia-smi", f'[ "$1" = "--query-gpu=compute_cap" ] || exit 9\nprintf "{lines}\\n"')
    if nvcc:
        _fake(bin_dir, "nvcc", 'echo "Cuda compilation tools, release 12.4"')
    tools = tmp_path / "tools"
    tools.mkdir(exist_ok=True)
    for tool in ("tr", "grep", "sort", "cat", "uname", "cut", "dirname", "bash"):  # what the scripts use
        found = subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True, text=True).stdout.strip()
        if found and not (tools / tool).exists():
            (tools / tool).symlink_to(found)
    full = {"PATH": f"{bin_dir}:{tools}", "CUDA_HOME": str(tmp_path / "no-cuda"), "HOME": str(tmp_path),
            **(env or {})}
    return subprocess.run(["/bin/bash", str(SCRIPT)], capture_output=True, text=True, env=full)


def test_a_cpu_machine_gets_no_cuda_flags(tmp_path: Path) -> None:
    done = _run(tmp_path, nvcc=True)  # a toolkit alone, no GPU: exactly today's CPU build
    assert done.returncode == 0 and done.stdout == "" and done.stderr == ""


def test_an_nvidia_gpu_with_a_toolkit_builds_for_its_architecture_only(tmp_path: Path) -> None:
    done = _run(tmp_path, gpus=["8.9"], nvcc=True)
    assert done.returncode == 0, done.stderr
    flags = done.stdout.split()
    assert "-DGGML_CUDA=ON" in flags and "-DGGML_CUDA_FA=ON" in flags and "-DGGML_CUDA_NCCL=OFF" in flags
    assert "-DCMAKE_CUDA_ARCHITECTURES=89-real" in flags
    assert not any(f.startswith("-DCMAKE_CUDA_COMPILER") for f in flags)  # nvcc is on PATH


def test_flash_attention_kernels_can_be_left_out_for_a_shorter_build(tmp_path: Path) -> None:
    off = _run(tmp_path, gpus=["9.0"], nvcc=True, env={"TANDEM_CUDA_FA": "0"})
    assert off.returncode == 0 and "-DGGML_CUDA_FA=OFF" in off.stdout.split()
    wrong = _run(tmp_path, gpus=["9.0"], nvcc=True, env={"TANDEM_CUDA_FA": "yes"})
    assert wrong.returncode == 1 and wrong.stdout == ""
    assert wrong.stderr.strip() == "error: TANDEM_CUDA_FA must be 0 or 1, not 'yes'"


def test_two_cards_of_two_kinds_get_both_architectures_once(tmp_path: Path) -> None:
    done = _run(tmp_path, gpus=["8.6", "9.0", "8.6"], nvcc=True)
    assert "-DCMAKE_CUDA_ARCHITECTURES=86-real;90-real" in done.stdout.split()


def test_a_gpu_without_a_toolkit_builds_for_the_cpu_and_says_why(tmp_path: Path) -> None:
    done = _run(tmp_path, gpus=["8.9"])
    assert done.returncode == 0 and done.stdout == ""
    assert "no CUDA toolkit (nvcc)" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_tandem_cuda_0_wins(tmp_path: Path) -> None:
    done = _run(tmp_path, gpus=["9.0"], nvcc=True, env={"TANDEM_CUDA": "0"})
    assert done.returncode == 0 and done.stdout == "" and done.stderr == ""


@pytest.mark.parametrize("gpus", [["8.9"], None])
def test_tandem_cuda_1_without_nvcc_fails_with_one_clear_line(tmp_path: Path, gpus) -> None:
    done = _run(tmp_path, gpus=gpus, env={"TANDEM_CUDA": "1"})
    assert done.returncode == 1 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: TANDEM_CUDA=1 but no CUDA compiler (nvcc)")


def test_tandem_cuda_1_builds_for_a_named_architecture_or_says_it_needs_one(tmp_path: Path) -> None:
    done = _run(tmp_path, nvcc=True, env={"TANDEM_CUDA": "1"})
    assert done.returncode == 1 and "TANDEM_CUDA_ARCH" in done.stderr and len(done.stderr.splitlines()) == 1
    done = _run(tmp_path, nvcc=True, env={"TANDEM_CUDA": "1", "TANDEM_CUDA_ARCH": "86"})
    assert done.returncode == 0 and "-DCMAKE_CUDA_ARCHITECTURES=86" in done.stdout.split()


def test_nvcc_outside_path_is_named_to_cmake(tmp_path: Path) -> None:
    cuda = tmp_path / "cuda"
    (cuda / "bin").mkdir(parents=True)
    _fake(cuda / "bin", "nvcc", "true")
    done = _run(tmp_path, gpus=["12.0"], env={"CUDA_HOME": str(cuda)})
    flags = done.stdout.split()
    assert "-DCMAKE_CUDA_ARCHITECTURES=120-real" in flags
    assert f"-DCMAKE_CUDA_COMPILER={cuda}/bin/nvcc" in flags


def test_a_wrong_value_is_refused(tmp_path: Path) -> None:
    done = _run(tmp_path, env={"TANDEM_CUDA": "yes"})
    assert done.returncode == 1 and "TANDEM_CUDA must be 0, 1 or unset" in done.stderr


def _flags(tmp_path: Path, script: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["/bin/bash", str(ROOT / "packaging" / script)], capture_output=True, text=True,
                          env={**os.environ, "CUDA_HOME": str(tmp_path / "no-cuda"), **env})


def test_the_build_flags_are_todays_on_a_cpu_machine_and_gain_cuda_with_a_gpu(tmp_path: Path) -> None:
    """What bootstrap.sh builds with (llama_flags.sh): cpu_flags.sh's line unchanged on a
    CPU machine (so its cached wheel's key too), the CUDA flags appended with a GPU, and
    a TANDEM_CUDA=1 that cannot be honoured stops the build."""
    _run(tmp_path)  # makes tmp_path/bin (the stand-ins) and tmp_path/tools (basic tools only)
    bin_dir = tmp_path / "bin"
    path = f"{bin_dir}:{tmp_path / 'tools'}"
    today = _flags(tmp_path, "cpu_flags.sh", {})
    cpu = _flags(tmp_path, "llama_flags.sh", {"PATH": path})
    assert cpu.returncode == 0 and cpu.stdout == today.stdout and "GGML_CUDA" not in cpu.stdout
    _fake(bin_dir, "nvidia-smi", 'printf "9.0\\n"')
    _fake(bin_dir, "nvcc", "true")
    gpu = _flags(tmp_path, "llama_flags.sh", {"PATH": path})
    assert gpu.stdout.startswith(today.stdout.strip() + " -DGGML_CUDA=ON ")
    assert "-DCMAKE_CUDA_ARCHITECTURES=90-real" in gpu.stdout.split()
    assert _flags(tmp_path, "llama_flags.sh", {"PATH": path, "TANDEM_CUDA": "0"}).stdout == today.stdout
    (bin_dir / "nvcc").unlink()
    forced = _flags(tmp_path, "llama_flags.sh", {"PATH": path, "TANDEM_CUDA": "1"})
    assert forced.returncode == 1 and forced.stdout == "" and "no CUDA compiler (nvcc)" in forced.stderr


def test_bootstrap_takes_its_flags_from_llama_flags_and_stops_when_they_fail() -> None:
    # bootstrap.sh takes the wheel folder from llama_wheel.sh, which takes its flags from
    # llama_flags.sh: both plain assignments under `set -e`, so a failure stops setup.
    bootstrap = (ROOT / "packaging" / "bootstrap.sh").read_text()
    wheel = (ROOT / "packaging" / "llama_wheel.sh").read_text()
    assert "set -euo pipefail" in bootstrap and "set -euo pipefail" in wheel
    assert "WHEELS=$(bash packaging/llama_wheel.sh" in bootstrap
    assert "CMAKE_ARGS=$(bash packaging/llama_flags.sh)" in wheel
