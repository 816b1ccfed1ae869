"""Fixtures of the chat app's terminal tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator

import pytest

IN_CI = os.environ.get("CI", "").lower() == "true"


@pytest.fixture()
def tmux() -> Iterator[Callable[..., str]]:
    """Run tmux commands on a private server (its own socket), killed afterwards."""
    if shutil.which("tmux") is None:
        message = "tmux is not installed (packaging/bootstrap.sh installs it)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    # one server per test: a name reused right after the previous test's kill-server can
    # reach the dying server ("server exited unexpectedly")
    socket = f"tandem-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def run(*args: str, check: bool = True) -> str:
        out = subprocess.run(["tmux", "-L", socket, *args], capture_output=True, text=True, timeout=30)
        if check and out.returncode != 0:
            raise AssertionError(f"tmux {args[0]} failed: {out.stderr}")
        return out.stdout

    yield run
    run("kill-server", check=False)
