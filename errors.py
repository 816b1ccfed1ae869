"""Errors users can act on, shared by every layer. The CLI prints ``str(error)`` and exits non-zero.

The bottom of the dependency graph (`tandem.errors`, at the package root): kernels, models,
runtime and app may all raise these, so the module imports nothing from Tandem
(tests/test_layering.py)."""

from __future__ import annotations


class TandemError(Exception):
    """Base for every error that should reach the user as one readable message."""

    exit_code = 1


class ModelNotFound(TandemError):
    exit_code = 2


class ModelFormatError(TandemError):
    """The file is not a valid model file (not GGUF, truncated, corrupted)."""

    exit_code = 3


class UnsupportedModel(TandemError):
    """A valid file whose architecture or tensor type this runtime cannot run."""

    exit_code = 4


class PromptError(TandemError):
    """Empty prompt, or a prompt that does not fit the context."""

    exit_code = 5


class EmptyPrompt(PromptError):
    """A prompt with nothing in it (a client's mistake, not a context too small)."""


class BudgetError(TandemError):
    """The requested memory budget cannot hold what was asked for."""

    exit_code = 6


class OfflineError(TandemError):
    """A network action was asked for while offline."""

    exit_code = 7


SIGNAL_HINTS = {
    "SIGKILL": "killed from outside, often by the kernel when memory ran out",
    "SIGSEGV": "a crash inside native code",
    "SIGABRT": "native code aborted",
    "SIGBUS": "a crash inside native code (bad memory access)",
    "SIGILL": "an instruction this CPU does not have",
}
"""What a signal that ends a child usually means, said beside its name."""


def child_failure(what: str, returncode: int | None, stderr: str = "") -> str:
    """How the child process ``what`` ended, as one line for an error message.

    A child killed by a signal (a negative ``returncode`` from :mod:`subprocess`) is named
    by the signal ("the process baseline child died of SIGSEGV (a crash inside native
    code)"), with its last line of error output when it left one: a native crash often
    leaves none, and a message ending at a colon says nothing. Otherwise the last line of
    its error output, or its exit status."""
    import signal

    last = (stderr or "").strip().splitlines()[-1:]
    tail = f": {last[0].strip()}" if last else ""
    if returncode is not None and returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        hint = SIGNAL_HINTS.get(name)
        return f"the {what} died of {name}" + (f" ({hint})" if hint else "") + tail
    if last:
        return last[0].strip()
    return f"the {what} ended with exit status {returncode}" if returncode is not None else f"the {what} ended"
