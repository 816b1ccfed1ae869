"""Errors users can act on, shared by every layer. The CLI prints ``str(error)`` and exits non-zero."""

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


class BudgetError(TandemError):
    """The requested memory budget cannot hold what was asked for."""

    exit_code = 6


class OfflineError(TandemError):
    """A network action was asked for while offline."""

    exit_code = 7
