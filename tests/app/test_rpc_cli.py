"""`tandem rpc-server` and `--rpc` from the outside: real processes, real exit codes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from conftest import IN_CI

from benchmarks.rpc import SERVER, free_port, wait_listening
from tandem.app.commands.engine_flags import rpc_servers
from tandem.errors import TandemError
from tandem.runtime.backends.rpc_probe import query_server

MiB = 2**20


def tandem_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "tandem.app.cli", *args]


def tandem(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(tandem_cmd(*args), capture_output=True, text=True, timeout=300, env=dict(os.environ))


@pytest.fixture(scope="module", autouse=True)
def server_binary() -> None:
    if not SERVER.exists():
        message = f"{SERVER} is not built (bash packaging/bootstrap.sh builds it)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)


def serve(*args: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen(tandem_cmd("rpc-server", "--port", str(port), "--threads", "1", *args),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_listening(port, proc)
    return proc, port


def stop(proc: subprocess.Popen) -> str:
    proc.kill()
    return proc.communicate(timeout=30)[1]


def test_rpc_server_binds_loopback_quietly_and_offers_mem() -> None:
    proc, port = serve("--mem", "1GiB")
    try:
        (device,) = query_server(f"127.0.0.1:{port}")
        assert device.free == device.total == 1024 * MiB
    finally:
        stderr = stop(proc)
    assert "NO authentication" not in stderr
    assert f"--rpc 127.0.0.1:{port}" in stderr  # tells the user what to type on the other machine


def test_rpc_server_warns_loudly_off_loopback() -> None:
    proc, port = serve("--host", "0.0.0.0")
    try:
        assert query_server(f"127.0.0.1:{port}")
    finally:
        stderr = stop(proc)
    assert "NO authentication" in stderr and "ssh -N -L" in stderr


def test_rpc_server_port_in_use_is_one_error_line() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        r = tandem("rpc-server", "--port", str(taken.getsockname()[1]))
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode != 0 and len(lines) == 1 and lines[0].startswith("tandem: error: Cannot listen")


def test_run_with_an_unreachable_server_is_one_error_line(real_models) -> None:
    r = tandem("run", "-m", str(real_models.qwen_05b), "-p", "hi", "-n", "4", "--rpc", f"127.0.0.1:{free_port()}")
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert lines[-1].startswith("tandem: error: Nothing listens"), r.stderr


def test_run_split_over_two_servers_writes_the_local_tokens(real_models) -> None:
    args = ["run", "-m", str(real_models.qwen_05b), "-p", "Write a Python function that reverses a string.",
            "-n", "8", "--threads", "1", "--ctx", "256", "--json"]
    local = tandem(*args)
    assert local.returncode == 0, local.stderr
    servers = [serve() for _ in range(2)]
    try:
        split = tandem(*args, "--rpc", ",".join(f"127.0.0.1:{port}" for _, port in servers))
    finally:
        for proc, _ in servers:
            stop(proc)
    assert split.returncode == 0, split.stderr
    assert json.loads(split.stdout)["token_ids"] == json.loads(local.stdout)["token_ids"]


def test_rpc_servers_come_from_the_config_file(isolated_home) -> None:
    assert rpc_servers(None) == ()
    (isolated_home / "config.toml").write_text('rpc = ["10.0.0.2:50052", "10.0.0.3"]\n')
    assert rpc_servers(None) == ("10.0.0.2:50052", "10.0.0.3:50052")
    assert rpc_servers("off") == ()  # the flag wins
    assert rpc_servers("h:1") == ("h:1",)
    (isolated_home / "config.toml").write_text("rpc = 5\n")
    with pytest.raises(TandemError, match="rpc must be"):
        rpc_servers(None)


def test_run_uses_the_configured_servers(real_models, isolated_home) -> None:
    port = free_port()
    (isolated_home / "config.toml").write_text(f'rpc = "127.0.0.1:{port}"\n')
    r = tandem("run", "-m", str(real_models.qwen_05b), "-p", "hi", "-n", "4")
    assert r.returncode != 0 and f"Nothing listens at 127.0.0.1:{port}" in r.stderr, r.stderr


def test_run_losing_a_server_keeps_the_text_and_ends_with_one_error(real_models) -> None:
    servers = [serve() for _ in range(2)]
    endpoints = ",".join(f"127.0.0.1:{port}" for _, port in servers)
    proc = subprocess.Popen(tandem_cmd("run", "-m", str(real_models.qwen_05b), "-p", "Write a long story about a robot.",
                                       "-n", "400", "--threads", "1", "--ctx", "512", "--draft-mode", "off",
                                       "--quiet", "--rpc", endpoints),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.read(1)  # the reply has started
        stop(servers[1][0])
        out, err = proc.communicate(timeout=120)
    finally:
        stop(servers[0][0])
    assert proc.returncode == 1, err
    assert (first + out).strip()  # the reply so far stays written
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith(f"tandem: error: Lost the RPC server: 127.0.0.1:{servers[1][1]}"), err
    assert "Traceback" not in err and "ggml" not in err.lower().replace("ggml-rpc", ""), err
