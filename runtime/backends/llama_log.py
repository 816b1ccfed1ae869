"""Where llama.cpp's log goes: nowhere, unless ``TANDEM_LLAMA_LOG=1``.

Installed on import by every module that loads a GGUF through llama.cpp
(:mod:`tandem.runtime.backends.llama_vocab`, which the backend imports), so no load ever
prints llama.cpp's own log, and no load needs llama-cpp-python to point the process's
stdout and stderr at /dev/null to keep it quiet (see
:data:`tandem.runtime.backends.llama_vocab.NO_FD_REDIRECT`).
"""

from __future__ import annotations

import ctypes
import os

import llama_cpp


@llama_cpp.llama_log_callback
def quiet_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """Silence llama.cpp's log: a failure surfaces as our one-line error (from the
    exception), and its warnings (e.g. a context a few draft slots past the trained
    length) are noise to a user. llama-cpp-python's own callback maps this build's log
    levels to an older enum and printed warnings while hiding errors.
    ``TANDEM_LLAMA_LOG=1`` shows everything, for debugging."""
    if os.environ.get("TANDEM_LLAMA_LOG"):
        os.write(2, text)


def install() -> None:
    """Route llama.cpp's log to :func:`quiet_log` again (after a caller installed its own)."""
    llama_cpp.llama_log_set(quiet_log, ctypes.c_void_p(0))


install()
