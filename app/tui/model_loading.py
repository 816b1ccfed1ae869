"""Loading the chat's model behind a progress line, and a chat's own models restored when
it is reopened.

:class:`ModelLoader` owns the engine the chat screen replies with: a load runs in a
thread worker (opening a GGUF takes seconds), its stages and the time so far show in
the status line, and a message sent meanwhile waits for it (:attr:`ModelLoader.queued`).
The widget-free part, choosing and opening the models, is :mod:`.model_choice`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from textual.message import Message

from tandem.app.history.database import ChatRecord
from tandem.app.tui.model_choice import (
    LoadProgress,
    ModelChoice,
    close_engine,
    engine_record,
    load_engine,
    restored_choice,
)
from tandem.app.tui.worker_host import WorkerHost
from tandem.errors import TandemError


class EngineReady(Message):
    """A load ended: the engine, or the error that stopped it."""

    def __init__(self, engine: Any, choice: ModelChoice, error: str | None) -> None:
        super().__init__()
        self.engine, self.choice, self.error = engine, choice, error


class ModelLoader:
    """The chat's engine and the load that replaces it.

    ``host`` runs the load's worker and receives :class:`EngineReady` (its handler calls
    :meth:`ready`); ``show_status`` writes the status line.
    """

    def __init__(self, host: WorkerHost, choice: ModelChoice, show_status: Callable[[str], None]) -> None:
        self.host = host
        self.show_status = show_status
        self.engine: Any = None
        """The engine replies use; ``None`` while a model loads or after one failed."""
        self.choice = choice
        """What :attr:`engine` was opened from (the new choice only once it loaded)."""
        self.progress: LoadProgress | None = None
        """Set while a model loads: what it is doing and since when (the status line)."""
        self.queued: int | None = None
        """The chat of a message sent while the model loaded: the message is stored and
        shown, and the reply starts when the model is ready (if that chat is open)."""

    @property
    def loading(self) -> bool:
        return self.progress is not None

    def load(self, choice: ModelChoice, *, after_paint: bool = False) -> None:
        """Close the current engine and open ``choice`` in a worker; the chat has no
        engine until :class:`EngineReady` arrives.

        With ``after_paint`` (the chat's first load) the chat is loading from now on (a
        message sent is queued) but the worker starts once the screen is drawn: the
        first load imports the runtime (numpy, llama.cpp), which would otherwise hold
        up the first paint of the input box."""
        old, self.engine = self.engine, None
        self.progress = LoadProgress(choice.target_name)
        self.show_status(self.progress.line())
        if after_paint:
            self.host.call_after_refresh(self._start, choice, old)
        else:
            self._start(choice, old)

    def _start(self, choice: ModelChoice, old: Any) -> None:
        self.host.run_worker(partial(self._load, choice, old), thread=True, group="load",
                             exclusive=True, exit_on_error=False)

    def queue(self, chat_id: int) -> None:
        """A message of ``chat_id`` waits for the load: say so on the status line."""
        self.queued = chat_id
        self.stage(None)

    def stage(self, stage: str | None) -> None:
        """A new stage of the load (``None``: the same one, redrawn)."""
        if self.progress is not None:
            if stage is not None:
                self.progress.stage = stage
            self.tick()

    def tick(self) -> None:
        """Once a second while a model loads: the status line shows the time so far."""
        if self.progress is not None:
            queued = " · your message is answered when the model is ready" if self.queued is not None else ""
            self.show_status(self.progress.line() + queued)

    def _load(self, choice: ModelChoice, old: Any) -> None:
        """The worker thread: close the old engine, open the new one, report either way."""
        close_engine(old)
        try:
            shown = self.progress

            def loaded(fraction: float) -> None:  # from llama.cpp, on this thread: the tick draws it
                if shown is not None:
                    shown.loaded = fraction

            engine = load_engine(choice, progress=lambda stage: self.host.call_from_thread(self.stage, stage),
                                 on_load=loaded)
            error = None
        except TandemError as exc:
            engine, error = None, str(exc)
        except Exception as exc:  # a model llama.cpp cannot load: say so, never a traceback
            engine, error = None, f"{type(exc).__name__}: {exc}"
        self.host.post_message(EngineReady(engine, choice, error))

    def ready(self, message: EngineReady) -> int | None:
        """Take the load's result; returns the chat whose queued message is to be answered
        now (``None``: none, or the load failed and the message keeps waiting)."""
        self.progress = None
        if message.error:
            self.show_status(f"Could not load {message.choice.target_name}: {message.error}")
            self.host.notify(message.error, severity="error", timeout=8)
            if self.queued is not None:
                self.host.notify("Your message is saved in the chat; it is answered once a model loads (Ctrl+T).",
                                 severity="warning", timeout=12)
            return None
        self.engine, self.choice = message.engine, message.choice
        self.show_status(self.model_line())
        for note in message.choice.notes:
            self.host.notify(note, severity="warning", timeout=8)
        queued, self.queued = self.queued, None
        return queued

    def model_line(self) -> str:
        """The status line's model part: target, and drafter with its mode."""
        line = f"Model {self.choice.target_name}"
        drafter = self.choice.drafter_name
        line += f" · drafter {drafter} ({self.choice.mode})" if drafter else " · no drafter"
        return line

    def restore(self, chat: ChatRecord | None) -> None:
        """Load the model and drafter ``chat`` last used, if they differ from the current
        ones; a file that has gone is reported and the current model kept."""
        if chat is None or not chat.engine:
            return
        choice = restored_choice(self.choice, chat.engine)
        if choice is None:
            self.host.notify(f"This chat used {chat.model}, which is no longer at "
                             f"{chat.engine.get('target')}: keeping {self.choice.target_name}.",
                             severity="warning", timeout=8)
        elif engine_record(choice) != engine_record(self.choice):
            self.load(choice)
