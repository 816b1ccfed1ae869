"""The command line of a Python child process that runs our code and nothing else.

A plain ``python -m tandem...`` puts the working directory first on ``sys.path``, so a
``bisect.py`` or ``numpy.py`` in the folder a user started Tandem from would run inside
the child. Children run isolated (``-I``: no working directory, no ``PYTHON*``
variables, no user site-packages) with the parent's import path, less the working
directory, set explicitly, so they find ``tandem`` however it is installed (a normal
or editable install, or a source tree on ``PYTHONPATH``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

_BOOT = ("import sys, json, runpy; sys.path[:] = json.loads(sys.argv.pop(1)) + sys.path; "
         "{run}")


def import_path() -> list[str]:
    """The parent's ``sys.path`` without the working directory (or relative entries)."""
    cwd = Path.cwd().resolve()
    out = []
    for entry in sys.path:
        if not entry or not os.path.isabs(entry):
            continue
        try:
            if Path(entry).resolve() == cwd:
                continue
        except OSError:
            continue
        out.append(entry)
    return out


def module_argv(module: str, *args: str) -> list[str]:
    """``python -m module args...``, isolated."""
    run = f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
    return [sys.executable, "-I", "-c", _BOOT.format(run=run), json.dumps(import_path()), *args]


def code_argv(code: str, *args: str) -> list[str]:
    """``python -c code args...``, isolated (``sys.argv[1:]`` are ``args``)."""
    run = f"exec(compile({code!r}, '<tandem child>', 'exec'), {{'__name__': '__main__'}})"
    return [sys.executable, "-I", "-c", _BOOT.format(run=run), json.dumps(import_path()), *args]
