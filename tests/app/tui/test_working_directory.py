"""No code from the working directory: `tandem run`, `plan`, `serve` and `chat`, started in
a folder that holds a hostile ``bisect.py``, ``json.py`` and ``numpy.py``, never import
them — neither the command itself nor the helper processes it starts (the machine
baseline, llama.cpp's buffer sizes, ...), which run with a fresh per-test cache."""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from live_server import free_port, wait_healthy
from tui_pilot import wait_for

HOSTILE = ("bisect", "json", "numpy")
TANDEM = Path(sys.executable).with_name("tandem")


@pytest.fixture
def hostile_dir(tmp_path: Path) -> Path:
    """A folder whose Python files each leave a marker in ``markers/`` when imported."""
    folder, markers = tmp_path / "checkout", tmp_path / "markers"
    folder.mkdir()
    markers.mkdir()
    for name in HOSTILE:
        (folder / f"{name}.py").write_text(
            f"import os\nopen(os.path.join({str(markers)!r}, {name!r} + '-' + str(os.getpid())), 'w').close()\n")
    return folder


def imported(hostile_dir: Path) -> list[str]:
    return sorted(p.name for p in (hostile_dir.parent / "markers").iterdir())


def test_run_and_plan_ignore_code_in_the_working_directory(hostile_dir, real_models) -> None:
    model = str(real_models.smollm2)
    for args in (["plan", "-m", model], ["run", "-m", model, "-p", "Hi", "-n", "4", "--threads", "1"]):
        done = subprocess.run([str(TANDEM), *args], cwd=hostile_dir, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert imported(hostile_dir) == [], (args, done.stderr)


def test_serve_ignores_code_in_the_working_directory(hostile_dir, real_models) -> None:
    port = free_port()
    proc = subprocess.Popen([str(TANDEM), "serve", "-m", str(real_models.smollm2), "--port", str(port),
                             "--ctx", "1024", "--threads", "1"], cwd=hostile_dir,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(proc, port, 120)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120,
                       json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert r.status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert imported(hostile_dir) == []


def test_chat_ignores_code_in_the_working_directory(tmux, hostile_dir, real_models, isolated_home) -> None:
    env = f"TANDEM_HOME={shlex.quote(str(isolated_home))} HF_HUB_OFFLINE=1 TERM=xterm-256color"
    command = (f"cd {shlex.quote(str(hostile_dir))} && env {env} {shlex.quote(str(TANDEM))} chat "
               f"-m {shlex.quote(str(real_models.smollm2))} --threads 1; echo TANDEM-EXITED $?; sleep 30")
    tmux("new-session", "-d", "-s", "chat", "-x", "110", "-y", "30", command)
    wait_for(tmux, f"Model {real_models.smollm2.stem}", timeout=180)
    tmux("send-keys", "-t", "chat", "C-q")
    pane = wait_for(tmux, "TANDEM-EXITED")
    assert "TANDEM-EXITED 0" in pane
    assert imported(hostile_dir) == []
