"""Dependencies point one way: app -> runtime -> kernels/models; kernels stay pure."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "kernels": {"tandem.app", "tandem.runtime", "tandem.models"},
    "models": {"tandem.app", "tandem.runtime"},
    "runtime": {"tandem.app"},
}


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_point_one_way(layer: str) -> None:
    bad = []
    for path in (ROOT / layer).rglob("*.py"):
        for name in imports_of(path):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[layer]):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


def test_kernels_do_no_io() -> None:
    io_modules = {"os", "pathlib", "sqlite3", "socket", "shutil", "subprocess", "requests", "httpx"}
    bad = [
        f"{p.relative_to(ROOT)} imports {n}"
        for p in (ROOT / "kernels").rglob("*.py")
        for n in imports_of(p)
        if n.split(".")[0] in io_modules
    ]
    assert not bad, "\n".join(bad)
