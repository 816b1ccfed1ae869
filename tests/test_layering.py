"""Dependencies point one way: app -> runtime -> kernels/models -> errors, and inside runtime
down its parts (:data:`RUNTIME_LAYERS`); kernels stay pure."""

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
"""What each layer may not import. ``tandem.errors`` is in no set: every layer raises its
errors, and it is the bottom (:func:`test_errors_is_the_bottom_layer`)."""
BOTTOM = ROOT / "errors.py"


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


def test_errors_is_the_bottom_layer() -> None:
    """``tandem.errors`` imports nothing from Tandem, so any layer, kernels included, can
    raise a :class:`~tandem.errors.TandemError` without an arrow pointing up."""
    mine = sorted(n for n in imports_of(BOTTOM) if n == "tandem" or n.startswith("tandem."))
    assert not mine, f"errors.py imports {mine}"
    users = {layer for layer in ("app", "runtime", "models")
             for p in (ROOT / layer).rglob("*.py") if "tandem.errors" in imports_of(p)}
    assert users == {"app", "runtime", "models"}, f"only {sorted(users)} import tandem.errors"
    assert not (ROOT / "models" / "errors.py").exists(), "a second errors module under models/"


RUNTIME_LAYERS: tuple[tuple[str, ...], ...] = (
    ("engine", "chat"),
    ("autocomplete", "chat_fit", "constrained"),
    ("planning",),
    ("speculative",),
    ("generate",),
    ("kv", "moe"),
    ("backends",),
    ("logprobs", "streaming_text", "machine", "choices"),
)
"""The runtime's parts, top to bottom: a module may import its own part and the parts
of lower rows, never a part of its own row or above. The engine builder opens and plans
everything; chat fits conversations (chat_fit) and constrains replies (constrained:
grammar masks around any speculative strategy); the planner prices drafters and strategies (speculative) and the torch
engine's KV compression and expert offload (kv, moe); speculation runs on the
generation loop (generate); kv and moe extend the torch engine's backend; backends sit
on the machine facts, text helpers and the words settings take (choices). Names are sub-packages or top-level modules of
``runtime``."""


def runtime_part(module: str) -> str | None:
    """``tandem.runtime.X...`` -> ``X`` (a sub-package or top-level module)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["tandem", "runtime"] else None


def test_runtime_parts_import_downward_only() -> None:
    """Every import between runtime parts points down :data:`RUNTIME_LAYERS`, counting
    imports inside functions and under ``TYPE_CHECKING``."""
    row = {name: i for i, names in enumerate(RUNTIME_LAYERS) for name in names}
    here = {p.stem if p.suffix == ".py" else p.name for p in (ROOT / "runtime").iterdir()
            if p.name != "__init__.py" and (p.suffix == ".py" or (p / "__init__.py").exists())}
    assert here == set(row), f"parts missing from RUNTIME_LAYERS or gone: {sorted(here ^ set(row))}"
    bad = []
    for path in (ROOT / "runtime").rglob("*.py"):
        part = path.relative_to(ROOT / "runtime").parts[0].removesuffix(".py")
        if part == "__init__":
            continue
        for name in imports_of(path):
            other = runtime_part(name)
            if other is not None and other != part and row[other] <= row[part]:
                bad.append(f"{path.relative_to(ROOT)} ({part}) imports {name} ({other})")
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


def _modules() -> dict[str, Path]:
    """Every module of the four installed packages and ``tandem.errors``, by its dotted name."""
    out = {"tandem.errors": BOTTOM}
    for top in ("app", "runtime", "kernels", "models"):
        for path in (ROOT / top).rglob("*.py"):
            parts = [p for p in path.relative_to(ROOT / top).with_suffix("").parts if p != "__init__"]
            out[".".join(["tandem", top, *parts])] = path
    return out


def _runtime_imports(path: Path, known: dict[str, Path]) -> set[str]:
    """Tandem modules ``path`` imports when run, at module level *or inside a function*
    (a function-local import only hides a cycle), not those under ``if TYPE_CHECKING``."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names if a.name in known)
            elif isinstance(child, ast.ImportFrom) and child.module:
                found.update(n for n in [child.module, *(f"{child.module}.{a.name}" for a in child.names)]
                             if n in known)
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def import_cycles() -> list[list[str]]:
    """Strongly connected groups of more than one module in the import graph (Tarjan)."""
    known = _modules()
    graph = {name: _runtime_imports(path, known) for name, path in known.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while (w := stack.pop()) != v:
                group.append(w)
            if group:
                cycles.append(sorted([v, *group]))

    for name in graph:
        if name not in index:
            connect(name)
    return cycles


def test_no_import_cycles() -> None:
    """Modules form a DAG, counting function-local imports: a cycle broken by moving an
    import into a function is still a cycle."""
    assert not import_cycles(), "\n".join(" <-> ".join(c) for c in import_cycles())


def test_installed_packages_never_import_the_developer_benchmarks() -> None:
    installed = [BOTTOM, *(p for top in ("app", "runtime", "kernels", "models") for p in (ROOT / top).rglob("*.py"))]
    bad = [f"{p.relative_to(ROOT)} imports {n}" for p in installed for n in imports_of(p)
           if n.split(".")[0] == "benchmarks"]
    assert not bad, "\n".join(bad)
