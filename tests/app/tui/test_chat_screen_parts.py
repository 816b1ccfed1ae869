"""The chat screen's collaborators: each works from what it is given, without a screen.

The model loader runs here against a recording :class:`WorkerHost` (the worker runs on
the test's thread), and the package's modules are checked to import the screen nowhere,
so the parts stay composed rather than mixed back in.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest

import tandem.app.tui.model_loading as model_loading
from tandem.app.history.database import History
from tandem.app.tui.model_choice import ModelChoice
from tandem.app.tui.model_loading import EngineReady, ModelLoader
from tandem.runtime.engine.spec import EngineSpec

TUI = Path(model_loading.__file__).parent


class RecordingHost:
    """A :class:`WorkerHost` that keeps what it is asked: workers, messages, toasts."""

    def __init__(self) -> None:
        self.workers: list[tuple[Callable[[], None], dict[str, Any]]] = []
        self.messages: list[Any] = []
        self.toasts: list[tuple[str, str]] = []
        self.after_refresh: list[Callable[[], Any]] = []
        """Callbacks waiting for the screen to be drawn (the test runs them)."""

    def run_worker(self, work: Callable[[], None], **options: Any) -> None:
        self.workers.append((work, options))

    def call_after_refresh(self, callback: Callable[..., Any], *args: Any) -> bool:
        self.after_refresh.append(partial(callback, *args))
        return True

    def post_message(self, message: Any) -> bool:
        self.messages.append(message)
        return True

    def call_from_thread(self, callback: Callable[..., Any], *args: Any) -> Any:
        return callback(*args)

    def notify(self, message: str, *, severity: str = "information", **_: Any) -> None:
        self.toasts.append((severity, message))


class FakeEngine:
    closed = False

    def close(self) -> None:
        self.closed = True


def loader_with(tmp_path: Path) -> tuple[ModelLoader, RecordingHost, list[str]]:
    host, lines = RecordingHost(), []
    return ModelLoader(host, ModelChoice(EngineSpec(tmp_path / "target.gguf")), lines.append), host, lines


def test_a_load_runs_in_one_exclusive_thread_worker_and_reports_its_stages(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loader, host, lines = loader_with(tmp_path)
    old, new = FakeEngine(), FakeEngine()
    loader.engine = old

    def opened(choice: ModelChoice, progress: Callable[[str], None], on_load: Callable[[float], None]) -> Any:
        progress("loading the model")
        assert lines[-1].startswith("Loading other: loading the model")
        return new

    monkeypatch.setattr(model_loading, "load_engine", opened)
    loader.load(loader.choice.with_models(tmp_path / "other.gguf", None))
    assert loader.engine is None and loader.loading and lines[-1].startswith("Loading other: starting")
    ((work, options),) = host.workers
    assert options == {"thread": True, "group": "load", "exclusive": True, "exit_on_error": False}
    work()
    assert old.closed
    (ready,) = host.messages
    assert isinstance(ready, EngineReady) and ready.engine is new and ready.error is None
    assert loader.ready(ready) is None
    assert loader.engine is new and loader.choice.target_name == "other" and not loader.loading
    assert lines[-1] == "Model other · drafter model-free (auto)"


def test_a_message_queued_during_a_load_is_answered_once_it_loads(tmp_path: Path) -> None:
    loader, host, lines = loader_with(tmp_path)
    loader.load(loader.choice)
    loader.queue(7)
    assert "your message is answered when the model is ready" in lines[-1]
    engine = FakeEngine()
    assert loader.ready(EngineReady(engine, loader.choice, None)) == 7
    assert loader.queued is None and loader.engine is engine


def test_the_first_load_starts_its_worker_once_the_screen_is_drawn(tmp_path: Path) -> None:
    """The worker imports the runtime: the input box is drawn first, and a message sent
    before the worker starts is queued like one sent during the load."""
    loader, host, lines = loader_with(tmp_path)
    loader.load(loader.choice, after_paint=True)
    assert loader.loading and lines[-1].startswith("Loading target: starting") and host.workers == []
    loader.queue(7)
    (drawn,) = host.after_refresh
    drawn()
    ((_, options),) = host.workers
    assert options["group"] == "load" and loader.queued == 7


def test_a_failed_load_keeps_the_queued_message_and_says_why(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    loader, host, lines = loader_with(tmp_path)

    def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("bad tensor")

    monkeypatch.setattr(model_loading, "load_engine", broken)
    loader.load(loader.choice)
    loader.queue(7)
    host.workers[0][0]()
    (failed,) = host.messages
    assert failed.error == "RuntimeError: bad tensor" and failed.engine is None
    assert loader.ready(failed) is None
    assert loader.queued == 7 and loader.engine is None and not loader.loading
    assert lines[-1] == "Could not load target: RuntimeError: bad tensor"
    assert [s for s, _ in host.toasts] == ["error", "warning"] and "answered once a model loads" in host.toasts[1][1]


def test_reopening_a_chat_whose_model_has_gone_keeps_the_current_one(tmp_path: Path) -> None:
    loader, host, _ = loader_with(tmp_path)
    history = History(tmp_path / "history.db")
    try:
        chat = history.create_chat(model="gone")
        chat = history.update_chat(chat.id, engine={"target": str(tmp_path / "gone.gguf"), "drafter": None})
        loader.restore(chat)
    finally:
        history.close()
    assert not host.workers and "no longer at" in host.toasts[0][1]


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in it (``TYPE_CHECKING`` blocks included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def type_checking_imports(path: Path) -> set[str]:
    """The modules ``path`` imports for type checking only (``if TYPE_CHECKING:``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            names |= {n.module for n in ast.walk(node) if isinstance(n, ast.ImportFrom) and n.module}
            names |= {a.name for n in ast.walk(node) if isinstance(n, ast.Import) for a in n.names}
    return names


def test_only_the_app_imports_the_chat_screen() -> None:
    """The screen creates its parts and hands them what they use: none of them (nor any
    other module of the chat app) imports the screen back, even for type checking, and
    none loads a module of the tree by ``importlib``. ``TYPE_CHECKING`` imports name the
    runtime's types only (kept out of the first paint), never a module of the chat app."""
    modules = sorted(p for p in TUI.glob("*.py") if p.name != "chat_screen.py")
    assert {"model_loading.py", "reply_stream.py", "transcript.py", "chat_actions.py"} <= {p.name for p in modules}
    importers = {p.name for p in modules if "tandem.app.tui.chat_screen" in imported_modules(p)}
    assert importers == {"app.py"}
    assert not [p.name for p in TUI.glob("*.py") if "importlib" in imported_modules(p)]
    assert not [(p.name, m) for p in TUI.glob("*.py") for m in type_checking_imports(p)
                if m.startswith("tandem.app.tui")]
    assert {m for p in TUI.glob("*.py") for m in type_checking_imports(p)}  # the check sees them
