"""A stand-in for ``sys.executable`` whose process dies of a signal, for the tests that
check how each place that runs a child reports it."""

from __future__ import annotations

from pathlib import Path


def dying_python(folder: Path, signal_name: str) -> Path:
    """An executable that kills itself with ``signal_name`` (``SEGV``, ``KILL``...) whatever
    it is asked to run, after a line on stderr only for ``KILL`` (a native crash usually
    leaves none)."""
    path = folder / f"python-dies-of-{signal_name.lower()}"
    note = 'echo "allocating 64 GiB" >&2\n' if signal_name == "KILL" else ""
    path.write_text(f"#!/bin/sh\n{note}kill -{signal_name} $$\n")
    path.chmod(0o755)
    return path
