"""The distribution: every package folder is listed, and a built wheel imports as `tandem.*`."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = {"app": "tandem.app", "runtime": "tandem.runtime", "kernels": "tandem.kernels", "models": "tandem.models"}
ROOT_MODULES = sorted(p.name for p in ROOT.glob("*.py"))
"""Modules at the repository root: modules of ``tandem`` itself (``errors.py`` is ``tandem.errors``)."""


def package_folders() -> set[str]:
    found = {"tandem"}  # the root: its modules are tandem's own (tandem.errors)
    for folder, name in TOP.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *rel)))
    return found


def test_every_package_folder_is_listed_in_pyproject() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(config["packages"]) == package_folders()
    assert config["package-dir"] == {"tandem": ".", **{v: k for k, v in TOP.items()}}
    assert ROOT_MODULES == ["errors.py"], "a module at the root ships as tandem.<name>"


def test_wheel_installs_and_imports_as_tandem(tmp_path: Path) -> None:
    # Build from a clean copy so no stale build/ folder can hide a missing file.
    src = tmp_path / "src"
    src.mkdir()
    for name in [*TOP, *ROOT_MODULES, "pyproject.toml", "README.md"]:
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy)(ROOT / name, src / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
         "-q", "-w", str(tmp_path / "dist")],
        check=True, timeout=300, capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("tandem-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.split("/")[0] in {*TOP, *ROOT_MODULES}], "generic top-level names leaked"
    sources = {str(p.relative_to(ROOT)) for f in TOP for p in (ROOT / f).rglob("*.py")} | set(ROOT_MODULES)
    in_wheel = {n.removeprefix("tandem/") for n in names if n.endswith(".py")}
    assert sources <= in_wheel, f"missing from wheel: {sorted(sources - in_wheel)[:5]}"
    data = {str(p.relative_to(ROOT)) for f in TOP for p in (ROOT / f).rglob("*") if p.suffix == ".tcss"}
    assert data and data <= {n.removeprefix("tandem/") for n in names}, "the chat app's stylesheet is missing"
    assert any(n.endswith("entry_points.txt") for n in names)
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True, timeout=300, capture_output=True,
    )
    # A bare interpreter (no editable install) must find every sub-package in the wheel.
    code = (
        "import tandem.app, tandem.runtime, tandem.kernels, tandem.models, tandem.runtime.streaming_text, tandem.errors;"
        "print(tandem.runtime.__file__); print(tandem.errors.__file__)"
    )
    out = subprocess.run(
        [getattr(sys, "_base_executable", sys.executable), "-I", "-c", f"import sys; sys.path.insert(0, {str(target)!r}); {code}"],
        check=True, timeout=60, capture_output=True, text=True,
    ).stdout
    assert all(line.startswith(str(target)) for line in out.splitlines()), out


def test_sdist_holds_every_module_and_the_stylesheet(tmp_path: Path) -> None:
    """pipx, uv and pip build from the source release (or the tree) alone: a module or the
    chat app's .tcss left out of it is missing from every install made that way."""
    src = tmp_path / "src"
    src.mkdir()
    for name in [*TOP, *ROOT_MODULES, "pyproject.toml", "README.md"]:
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy)(ROOT / name, src / name)
    code = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    built = subprocess.run([sys.executable, "-c", code, str(tmp_path / "dist")], cwd=src, check=True,
                           timeout=300, capture_output=True, text=True)
    sdist = tmp_path / "dist" / built.stdout.strip().splitlines()[-1]
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    wanted = {str(p.relative_to(ROOT)) for f in TOP for p in (ROOT / f).rglob("*")
              if p.suffix in (".py", ".tcss") and "__pycache__" not in p.parts} | set(ROOT_MODULES)
    assert wanted <= names, f"missing from the sdist: {sorted(wanted - names)[:5]}"
    assert {"pyproject.toml", "README.md"} <= names
