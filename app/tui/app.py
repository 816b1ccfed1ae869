"""`TandemApp`: the Textual application behind ``tandem chat``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from rich.segment import Segments
from textual.app import App
from textual.binding import Binding
from textual.notifications import SeverityLevel

from tandem.app.history.database import History, HistoryDamaged, default_path
from tandem.app.tui.chat_screen import ChatScreen
from tandem.app.tui.modals import NoModelScreen
from tandem.app.tui.model_choice import ModelChoice, close_engine, restored_choice
from tandem.app.tui.session import ChatSettings
from tandem.app.tui.shown import plain
from tandem.models.paths import models_dir
from tandem.models.store import list_models
from tandem.runtime.engine.spec import EngineSpec


def open_history(path: Path | None) -> tuple[History, str | None]:
    """The chat history, and a notice when a damaged file had to be set aside.

    A damaged file (failed integrity check) is renamed, never deleted, with its WAL
    files, and the app starts on a fresh one: a broken history costs a message on
    screen, not the app. Everything else (a locked or unreadable file) stays an error.
    """
    try:
        return History(path), None
    except HistoryDamaged as exc:
        bad = Path(path) if path is not None else default_path()
        kept = bad.with_name(f"{bad.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
        for suffix in ("", "-wal", "-shm"):
            src = bad.with_name(bad.name + suffix)
            if src.exists():
                src.rename(kept.with_name(kept.name + suffix))
        return History(path), f"{exc} It was kept as {kept.name} and a new history was started."


@dataclass
class AppConfig:
    model: Path | None = None
    """Target model; ``None`` picks the first in the store (or shows how to get one)."""
    drafter: Path | None = None
    history_path: Path | None = None
    settings: ChatSettings = field(default_factory=ChatSettings)
    """Settings new chats start with."""
    n_ctx: int | None = None
    threads: int | None = None
    export_dir: Path = field(default_factory=Path.cwd)
    mask_timings: bool = False
    """Show ``--`` for wall-clock figures (deterministic snapshots)."""
    draft_mode: str | None = None
    """Speculative decoding mode (``runtime.speculative``); ``None``: auto."""
    draft_max: int = 8
    draft_len: int | None = None
    measure_cost: bool = True
    budget: str | None = None
    """Host memory budget for the memory planner (``tandem chat --budget``)."""
    placement: str = "auto"
    """Where drafter and target run: ``auto`` (measured once, cached), ``gpu``, ``cpu`` or ``target-gpu``."""
    fast_verify: bool = False
    engine: EngineSpec | None = None
    """The command line's other engine settings (``tandem chat --kv-type ...``)."""

    def choice(self, model: Path) -> ModelChoice:
        """What opens ``model`` with these settings (``engine``'s others kept)."""
        return ModelChoice(replace(self.engine or EngineSpec(model), target=model, drafter=self.drafter,
                                   draft_mode=self.draft_mode or "auto", draft_max=self.draft_max,
                                   draft_len=self.draft_len, budget=self.budget, placement=self.placement,
                                   threads=self.threads, n_ctx=self.n_ctx, fast_verify=self.fast_verify,
                                   measure_cost=self.measure_cost))


class TandemApp(App):
    CSS_PATH = "tandem.tcss"
    TITLE = "Tandem"
    BINDINGS = [Binding("ctrl+q", "quit", "Quit", priority=True)]

    def __init__(self, config: AppConfig | None = None) -> None:
        super().__init__()
        self.config = config or AppConfig()
        self.history, self.history_notice = open_history(self.config.history_path)

    def notify(self, message: str, *, title: str = "", severity: SeverityLevel = "information",
               timeout: float | None = None, markup: bool = True) -> None:
        """Every notification (screens and widgets send theirs here) quotes titles, file
        names or errors: shown cleaned and literally, never as markup."""
        super().notify(plain(message), title=plain(title), severity=severity, timeout=timeout, markup=False)

    def on_mount(self) -> None:
        if self.history_notice:
            self.notify(self.history_notice, severity="warning", timeout=20)
        choice = self.initial_choice()
        if choice is None:
            self.push_screen(NoModelScreen(models_dir()))
            return
        self.push_screen(ChatScreen(choice, self.history, self.config.settings,
                                    export_dir=self.config.export_dir, mask_timings=self.config.mask_timings))

    def initial_choice(self) -> ModelChoice | None:
        """The model to start with: the one asked for (``-m``), else the models of the
        most recent chat (it opens first), else the first in the store."""
        if self.config.model is not None:
            return self.config.choice(self.config.model)
        for chat in self.history.list_chats()[:1]:
            if chat.engine:
                restored = restored_choice(self.config.choice(Path(chat.engine["target"])), chat.engine)
                if restored is not None:
                    return restored
        entries = list_models()
        return self.config.choice(entries[0].path) if entries else None

    def chat_screen(self) -> ChatScreen | None:
        for screen in self.screen_stack:
            if isinstance(screen, ChatScreen):
                return screen
        return None

    async def action_quit(self) -> None:
        """Quit cleanly mid-reply: cancel, wait until the partial reply is stored, exit."""
        screen = self.chat_screen()
        if screen is not None:
            await screen.stop_generation(wait=True)
        self.exit()

    def _fatal_error(self) -> None:
        """Textual's crash report without local variables (it shows them by default, and
        they can hold the user's prompt or replies): the traceback alone."""
        # local: only a crash needs it (rich.traceback and its syntax highlighting)
        from rich.traceback import Traceback

        self.bell()
        report = Traceback(show_locals=False, width=None)
        self._exit_renderables.append(Segments(self.console.render(report, self.console.options)))
        self._close_messages_no_wait()

    def on_unmount(self) -> None:
        screen = self.chat_screen()
        if screen is not None and screen.replies.cancel is not None:
            screen.replies.cancel.set()
        if screen is not None and not screen.generating:
            close_engine(screen.engine)
        self.history.close()
