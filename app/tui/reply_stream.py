"""Streaming one reply: the generation worker, the throttled drawing, stopping it.

Generation runs in a thread worker (llama.cpp releases the GIL, so the UI keeps
drawing); the worker writes every fragment to the history itself and posts
:class:`ReplyStarted` and :class:`ReplyDone` to the host screen, whose handlers call
:meth:`ReplyStream.started` and :meth:`ReplyStream.finish`. What it streamed waits in a
:class:`~tandem.app.tui.session.ReplyBuffer` until :meth:`ReplyStream.drain` draws it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace
from functools import partial
from typing import Any

from textual.message import Message
from textual.worker import Worker

from tandem.app.history.database import INTERRUPTED, ChatRecord, History, MessageRecord
from tandem.app.tui.model_choice import ModelChoice
from tandem.app.tui.session import ReplyBuffer, run_reply
from tandem.app.tui.transcript import Transcript
from tandem.app.tui.widgets import MessageView
from tandem.app.tui.worker_host import WorkerHost
from tandem.errors import TandemError

DRAW_DUTY = 4.0
"""Wait this many times the last draw's duration before drawing streamed text again."""


class ReplyStarted(Message):
    """The worker stored the reply's record: it can be shown."""

    def __init__(self, record: MessageRecord) -> None:
        super().__init__()
        self.record = record


class ReplyDone(Message):
    """The worker ended: the stored reply, or the error that stopped it."""

    def __init__(self, record: MessageRecord | None, error: str | None) -> None:
        super().__init__()
        self.record, self.error = record, error


def failure_text(exc: BaseException) -> str:
    """One line for an unexpected failure: its kind and message, never a traceback."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class ReplyStream:
    """At most one reply at a time, from its worker into its view in ``transcript``."""

    def __init__(self, host: WorkerHost, history: History, transcript: Transcript) -> None:
        self.host, self.history, self.transcript = host, history, transcript
        self.cancel: threading.Event | None = None
        """Set to stop the running reply at its next token (Esc, quitting)."""
        self.worker: Worker[Any] | None = None
        self.view: MessageView | None = None
        """The running reply's view, once it is shown: the drain timer draws into it."""
        self.choice: ModelChoice | None = None
        """The models of the running reply (its role line names them)."""
        self.buffer = ReplyBuffer()
        self._drawing = asyncio.Lock()
        """Held while streamed text is drawn into the reply's view: the reply's end waits
        for a draw in progress, so the stored record it shows is the last word."""
        self._next_drain = 0.0

    @property
    def running(self) -> bool:
        return self.worker is not None

    def start(self, engine: Any, chat: ChatRecord, choice: ModelChoice, resume: MessageRecord | None = None) -> None:
        """Generate the next reply of ``chat`` with ``engine``, or with ``resume``
        continue that interrupted one."""
        self.cancel = threading.Event()
        self.view = None
        self.choice = choice
        self.buffer = ReplyBuffer()
        self.worker = self.host.run_worker(partial(self._generate, engine, chat, choice, self.cancel, self.buffer,
                                                   resume),
                                           thread=True, group="generate", exclusive=True, exit_on_error=False)

    def _generate(self, engine: Any, chat: ChatRecord, choice: ModelChoice, cancel: threading.Event,
                  buffer: ReplyBuffer, resume: MessageRecord | None) -> None:
        """The worker thread: run the reply into the history, report how it ended."""
        try:
            record = run_reply(engine, self.history, chat, cancel=cancel,
                               on_token=lambda event, _n, live: buffer.push(event.text, live),
                               on_start=lambda r: self.host.post_message(ReplyStarted(r)),
                               model_name=choice.target_name,
                               drafter_name=choice.drafter_name, resume=resume)
            error = None
        except TandemError as exc:
            record, error = None, str(exc)
        except Exception as exc:  # a locked or full database, a native failure: never a wedged app
            record, error = None, f"The reply stopped: {failure_text(exc)}"
        self.host.post_message(ReplyDone(record, error))

    async def started(self, record: MessageRecord) -> None:
        """Show the reply the worker started: a new view, or the continued reply's own."""
        if self.choice is not None:
            record.stats = {"model": self.choice.target_name, "drafter": self.choice.drafter_name}
        view = self.transcript.find(record.id)
        if view is not None:  # a continued reply: stream into the view that shows it
            view.streaming = True
        else:
            view = await self.transcript.add(record, streaming=True)
        self.view = view  # only now: the drain timer may draw into it
        self.transcript.scroll_end(animate=False)

    async def drain(self) -> None:
        """Draw what the worker has streamed since the last draw (runs on a timer).

        Drawing holds the GIL the worker needs between llama.cpp calls, so after a draw
        that took ``d`` seconds the next waits at least ``DRAW_DUTY * d``: the screen
        never takes more than about a fifth of the time from generation.
        """
        now = time.perf_counter()
        if self.view is None or self._drawing.locked() or now < self._next_drain:
            return
        async with self._drawing:
            await self._draw(now)

    async def _draw(self, started: float) -> None:
        """One draw of what was streamed (the caller holds :attr:`_drawing`)."""
        update = self.buffer.drain()
        if update is None or self.view is None:
            return
        try:
            await self.view.append(*update)
        finally:
            self._next_drain = time.perf_counter() + DRAW_DUTY * (time.perf_counter() - started)
        self.transcript.follow()

    async def finish(self, message: ReplyDone) -> MessageView | None:
        """The worker ended: draw the rest, show the stored reply and any error. Returns
        the reply's view, ``None`` when it ended before one was shown."""
        async with self._drawing:  # after a draw in progress, never before it
            await self._draw(time.perf_counter())
            view, self.view = self.view, None
        self.worker, self.cancel = None, None
        if message.error:
            self.host.notify(message.error, severity="error", timeout=12)
        if view is not None and message.record is not None:
            await view.finish(message.record)  # stored content, status and stats
        elif view is not None:  # failed mid-reply: keep what was shown, marked interrupted
            await view.finish(replace(view.record, status=INTERRUPTED))
        return view

    async def stop(self, wait: bool = False) -> None:
        """Cancel the running reply; with ``wait``, until its partial text is stored."""
        if self.cancel is not None:
            self.cancel.set()
        worker = self.worker
        if wait and worker is not None:
            await worker.wait()
