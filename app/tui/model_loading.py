"""The chat screen's model loading: a worker thread, its stages and time in the status
line, and a chat's own models restored when it is reopened.

A mixin like :mod:`.chat_actions`, so ``chat_screen.py`` stays about the conversation;
the widget-free part (choosing and opening the models) is :mod:`.engine`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from textual import work
from textual.message import Message

from tandem.app.tui.model_choice import (
    LoadProgress,
    ModelChoice,
    close_engine,
    engine_record,
    load_engine,
    restored_choice,
)
from tandem.errors import TandemError

if TYPE_CHECKING:
    from tandem.app.tui.chat_screen import ChatScreen


class EngineReady(Message):
    def __init__(self, engine: Any, choice: ModelChoice, error: str | None) -> None:
        super().__init__()
        self.engine, self.choice, self.error = engine, choice, error


class ModelLoading:
    """Mixed into :class:`ChatScreen` (``self`` is the screen)."""

    engine: Any
    choice: ModelChoice
    load_progress: LoadProgress | None

    def load_model(self: ChatScreen, choice: ModelChoice) -> None:
        old, self.engine = self.engine, None
        self.load_progress = LoadProgress(choice.target_name)
        self.set_status(self.load_progress.line())
        self._load(choice, old)

    def _loading_stage(self: ChatScreen, stage: str | None) -> None:
        """A new stage of the load (``None``: the same one, redrawn)."""
        if self.load_progress is not None:
            if stage is not None:
                self.load_progress.stage = stage
            self._tick()

    def _tick(self: ChatScreen) -> None:
        """Once a second while a model loads: the status line shows the time so far."""
        if self.load_progress is not None:
            queued = " · your message is answered when the model is ready" if self.queued is not None else ""
            self.set_status(self.load_progress.line() + queued)

    @work(thread=True, group="load", exclusive=True, exit_on_error=False)
    def _load(self: ChatScreen, choice: ModelChoice, old: Any) -> None:
        close_engine(old)
        try:
            shown = self.load_progress

            def loaded(fraction: float) -> None:  # from llama.cpp, on this thread: the tick draws it
                if shown is not None:
                    shown.loaded = fraction

            engine = load_engine(choice, progress=lambda stage: self.app.call_from_thread(self._loading_stage, stage),
                                 on_load=loaded)
            error = None
        except TandemError as exc:
            engine, error = None, str(exc)
        except Exception as exc:  # a model llama.cpp cannot load: say so, never a traceback
            engine, error = None, f"{type(exc).__name__}: {exc}"
        self.post_message(EngineReady(engine, choice, error))

    async def on_engine_ready(self: ChatScreen, message: EngineReady) -> None:
        self.load_progress = None
        if message.error:
            self.set_status(f"Could not load {message.choice.target_name}: {message.error}")
            self.notify(message.error, severity="error", timeout=8)
            if self.queued is not None:
                self.notify("Your message is saved in the chat; it is answered once a model loads (Ctrl+T).",
                            severity="warning", timeout=12)
            return
        self.engine, self.choice = message.engine, message.choice
        self.set_status(self._model_line())
        for note in message.choice.notes:
            self.notify(note, severity="warning", timeout=8)
        queued, self.queued = self.queued, None
        if queued is not None and self.chat is not None and self.chat.id == queued and not self.generating:
            await self.start_reply()

    def _model_line(self: ChatScreen) -> str:
        line = f"Model {self.choice.target_name}"
        drafter = self.choice.drafter_name
        line += f" · drafter {drafter} ({self.choice.mode})" if drafter else " · no drafter"
        return line

    def restore_model(self: ChatScreen) -> None:
        """Load the model and drafter the open chat last used, if they differ from the
        current ones; a file that has gone is reported and the current model kept."""
        if self.chat is None or not self.chat.engine:
            return
        choice = restored_choice(self.choice, self.chat.engine)
        if choice is None:
            self.notify(f"This chat used {self.chat.model}, which is no longer at "
                        f"{self.chat.engine.get('target')}: keeping {self.choice.target_name}.",
                        severity="warning", timeout=8)
        elif engine_record(choice) != engine_record(self.choice):
            self.load_model(choice)
