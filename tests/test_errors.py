"""How a child process's end is said: a signal by name, never an empty message."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from child_signals import dying_python

from tandem.errors import ModelFormatError, child_failure


@pytest.mark.parametrize(("signal_name", "returncode"), [("SIGSEGV", -11), ("SIGKILL", -9)])
def test_a_child_killed_by_a_signal_is_named_by_it(signal_name: str, returncode: int) -> None:
    code = f"import os, signal; os.kill(os.getpid(), signal.{signal_name})"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == returncode
    said = child_failure("process baseline child", proc.returncode, proc.stderr)
    assert said.startswith(f"the process baseline child died of {signal_name} (")


def test_error_output_and_exit_status() -> None:
    assert child_failure("x child", 1, "Traceback ...\nValueError: bad value\n") == "ValueError: bad value"
    assert child_failure("x child", 3, "") == "the x child ended with exit status 3"
    assert child_failure("x child", -9, "loading\nMemoryError\n").endswith("memory ran out): MemoryError")
    assert child_failure("x child", -250, "") == "the x child died of signal 250"


@pytest.mark.parametrize("signal_name", ["SEGV", "KILL"])
def test_the_quantizer_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, signal_name: str) -> None:
    from tandem.models.quantize import cached_copy

    src = tmp_path / "model.gguf"
    src.write_bytes(b"GGUF")
    monkeypatch.setattr(sys, "executable", str(dying_python(tmp_path, signal_name)))
    with pytest.raises(ModelFormatError, match=f"the quantizer child died of SIG{signal_name} "):
        cached_copy(src, "q8_0")
