"""Child Python processes run isolated from the working directory but keep the parent's
import path (so ``tandem`` is found however it is installed, even from PYTHONPATH)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PARENT = ("import subprocess, sys\n"
          "from tandem.models.python_child import code_argv\n"
          "done = subprocess.run(code_argv(sys.argv[1], 'a b', '--x'), capture_output=True, text=True)\n"
          "print(done.stdout, end=''); print(done.stderr, end='', file=sys.stderr); sys.exit(done.returncode)\n")


def test_child_ignores_the_working_directory_but_keeps_the_import_path(tmp_path: Path) -> None:
    cwd, lib, markers = tmp_path / "cwd", tmp_path / "lib", tmp_path / "markers"
    for d in (cwd, lib, markers):
        d.mkdir()
    for name in ("json", "bisect", "numpy"):
        (cwd / f"{name}.py").write_text(f"open({str(markers / name)!r}, 'w').close()\n")
    (lib / "only_on_pythonpath.py").write_text("VALUE = 7\n")
    child = ("import sys, json, bisect, numpy, only_on_pythonpath, tandem.models.python_child\n"
             "print(only_on_pythonpath.VALUE, sys.argv[1:])\n")
    env = {**os.environ, "PYTHONPATH": str(lib)}
    # the parent is started as a script outside cwd, as the `tandem` console script is
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    done = subprocess.run([sys.executable, str(script), child], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "7 ['a b', '--x']"
    assert list(markers.iterdir()) == []
