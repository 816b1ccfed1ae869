"""The main screen: chat list, messages, input; every chat action is a keyboard binding.

Generation runs in a thread worker (llama.cpp releases the GIL, so the UI keeps
drawing); the worker writes every fragment to the history itself and posts messages to
this screen, which only renders. Esc sets the worker's cancel event, and quitting
waits for the worker to store the partial reply before the app exits.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, Header, Label, OptionList
from textual.worker import Worker

from tandem.app.history.store import INTERRUPTED, ChatRecord, MessageRecord
from tandem.app.tui.chat_actions import ChatActions
from tandem.app.tui.model_choice import LoadProgress, ModelChoice, engine_record
from tandem.app.tui.model_loading import ModelLoading
from tandem.app.tui.reply_actions import ReplyActions
from tandem.app.tui.session import ReplyBuffer, run_reply, title_from
from tandem.app.tui.shown import plain, shown
from tandem.app.tui.widgets import ChatInput, ChatList, MessageView
from tandem.errors import TandemError

if TYPE_CHECKING:
    from tandem.app.tui.app import TandemApp


DRAW_DUTY = 4.0
"""Wait this many times the last draw's duration before drawing streamed text again."""


class ReplyStarted(Message):
    def __init__(self, record: MessageRecord) -> None:
        super().__init__()
        self.record = record


def failure_text(exc: BaseException) -> str:
    """One line for an unexpected failure: its kind and message, never a traceback."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class ReplyDone(Message):
    def __init__(self, record: MessageRecord | None, error: str | None) -> None:
        super().__init__()
        self.record, self.error = record, error


class ChatScreen(ChatActions, ReplyActions, ModelLoading, Screen):
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (100, "-wide")]
    # The footer shows short labels (all fit at 80 columns: test_tui_daily checks it in the
    # Pilot); the tooltip is the full description F1 lists, with the keys not in the footer.
    BINDINGS = [
        Binding("escape", "stop", "Stop", tooltip="Stop the reply / cancel editing"),
        Binding("ctrl+n", "new_chat", "New", priority=True, tooltip="New chat"),
        Binding("ctrl+r", "regenerate", "Redo", priority=True, tooltip="Regenerate the last reply"),
        Binding("ctrl+e", "edit_last", "Edit", priority=True,
                tooltip="Edit and resend your last message"),
        Binding("ctrl+o", "settings", "Set", priority=True, tooltip="System prompt and sampling for this chat"),
        Binding("ctrl+t", "models", "Model", priority=True, tooltip="Model and drafter"),
        Binding("ctrl+f", "search", "Find", priority=True, tooltip="Search all chats"),
        Binding("f5", "copy_code", "Copy", tooltip="Copy a code block (again: the one before)"),
        # priority: the input box would take F6/F7 (select line / select all)
        Binding("f6", "copy_reply", "Copy reply", show=False, priority=True, tooltip="Copy the whole reply"),
        Binding("f7", "continue_reply", "Continue", show=False, priority=True,
                tooltip="Continue an interrupted reply"),
        Binding("f3", "toggle_thinking", "Thinking", show=False, tooltip="Show / hide <think> blocks"),
        Binding("ctrl+s", "export", "Export", show=False, priority=True, tooltip="Export the chat to Markdown"),
        Binding("f2", "rename", "Rename", show=False, tooltip="Rename the chat"),
        Binding("f8", "delete_chat", "Delete", show=False, tooltip="Delete the chat"),
        Binding("f4", "toggle_drafted", "Drafted", show=False, tooltip="Colour the tokens the drafter wrote"),
        Binding("ctrl+b", "toggle_sidebar", "Sidebar", show=False, priority=True, tooltip="Show / hide the chat list"),
        Binding("f9,ctrl+space", "autocomplete", "Autocomplete", show=False,
                tooltip="Edit the message with autocomplete"),
        Binding("f1", "help", "Help", tooltip="All keys"),
    ]

    def __init__(self, choice: ModelChoice) -> None:
        super().__init__()
        self.choice = choice
        self.engine: Any = None
        self.chat: ChatRecord | None = None
        self.cancel: threading.Event | None = None
        self.worker: Worker | None = None
        self.reply_view: MessageView | None = None
        self.editing: int | None = None
        self.show_drafted = False
        self.buffer = ReplyBuffer()
        self._drawing = asyncio.Lock()
        """Held while streamed text is drawn into the reply's view: the reply's end waits
        for a draw in progress, so the stored record it shows is the last word."""
        self._next_drain = 0.0
        self.load_progress: LoadProgress | None = None
        """Set while a model loads: what it is doing and since when (the status line)."""
        self.replies_done = 0
        """Replies finished (or stopped) on this screen: tests wait on it."""
        self.queued: int | None = None
        """The chat of a message sent while the model loaded: the message is stored and
        shown, and the reply starts when the model is ready (if that chat is open)."""

    @property
    def tandem(self) -> TandemApp:
        return self.app  # type: ignore[return-value]

    @property
    def generating(self) -> bool:
        return self.worker is not None

    @property
    def input(self) -> ChatInput:
        return self.query_one("#input", ChatInput)

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False, icon="≈")
        with Horizontal():
            with Vertical(id="sidebar"):
                yield Label("Chats", classes="sidebar-title")
                yield ChatList(id="chat-list")
            with Vertical(id="main"):
                yield VerticalScroll(id="messages")
                yield Label("", id="edit-banner")
                yield ChatInput(id="input", placeholder="Message (Enter sends, Ctrl+J newline)")
                yield Label("", id="status")
        yield Footer(compact=True, show_command_palette=False)

    async def on_mount(self) -> None:
        self.query_one("#edit-banner").display = False
        chats = self.tandem.history.list_chats()
        self.refresh_chat_list()
        if chats:
            await self.open_chat(chats[0].id)
        else:
            self.sub_title = "New chat"
        self.input.focus()
        self.load_model(self.choice)
        self.set_interval(1 / 15, self._drain)
        self.set_interval(1.0, self._tick)

    def set_status(self, text: str) -> None:
        self.query_one("#status", Label).update(shown(text))

    # -- chats --------------------------------------------------------------------
    def refresh_chat_list(self) -> None:
        chats = self.tandem.history.list_chats()
        self.query_one("#chat-list", ChatList).set_chats(chats, self.chat.id if self.chat else None)

    async def open_chat(self, chat_id: int | None) -> None:
        history = self.tandem.history
        self.chat = history.get_chat(chat_id) if chat_id is not None else None
        self.editing = None
        self.query_one("#edit-banner").display = False
        box = self.query_one("#messages", VerticalScroll)
        await box.remove_children()
        if self.chat is not None:
            views = [self._view(m) for m in history.messages(self.chat.id)]
            await box.mount_all(views)
        self.sub_title = plain(self.chat.title) if self.chat else "New chat"
        box.scroll_end(animate=False)

    def _view(self, record: MessageRecord, streaming: bool = False) -> MessageView:
        return MessageView(record, mask_timings=self.tandem.config.mask_timings,
                           show_drafted=self.show_drafted, streaming=streaming,
                           show_thinking=self.show_thinking)

    def _ensure_chat(self) -> ChatRecord:
        if self.chat is None:
            self.chat = self.tandem.history.create_chat(
                params=self.tandem.config.settings.to_dict(),
                model=self.choice.target_name, drafter=self.choice.drafter_name)
        return self.chat

    def _busy(self) -> bool:
        if self.generating:
            self.notify("A reply is being generated: press Esc to stop it first.", severity="warning")
        return self.generating

    @on(OptionList.OptionSelected, "#chat-list")
    async def _chat_selected(self, event: OptionList.OptionSelected) -> None:
        if not self._busy() and event.option.id is not None:
            await self.open_chat(int(event.option.id))
            self.restore_model()
            self.input.focus()

    # -- sending and generation ----------------------------------------------------
    @on(ChatInput.Submitted)
    async def _submitted(self, event: ChatInput.Submitted) -> None:
        await self.send(event.text)

    async def send(self, text: str) -> None:
        if self._busy():
            return
        if self.engine is None and self.load_progress is None:
            self.notify("No model is loaded (it failed to load): choose one with Ctrl+T.", severity="warning")
            return
        try:
            record = await self._store_user_message(text)
        except sqlite3.Error as exc:  # the typed text stays in the input: nothing is lost
            self.notify(f"Your message could not be saved ({failure_text(exc)}); it is still in the input. "
                        "Try again when the disk or the database is free.", severity="error", timeout=12)
            return
        self.input.clear()
        await self.query_one("#messages").mount(self._view(record))
        self.refresh_chat_list()
        if self.engine is None:  # still loading: answered as soon as the model is ready
            self.queued = record.chat_id
            self._loading_stage(None)
            return
        await self.start_reply()

    async def _store_user_message(self, text: str) -> MessageRecord:
        history = self.tandem.history
        if self.editing is not None and self.chat is not None:
            history.delete_from(self.chat.id, self.editing)
            await self.open_chat(self.chat.id)
        chat = self._ensure_chat()
        if chat.title == "New chat":
            chat = self.chat = history.update_chat(chat.id, title=title_from(text))
            self.sub_title = plain(chat.title)
        engine = engine_record(self.choice)
        if (chat.model, chat.drafter, chat.engine) != (self.choice.target_name, self.choice.drafter_name, engine):
            chat = self.chat = history.update_chat(
                chat.id, model=self.choice.target_name, drafter=self.choice.drafter_name, engine=engine)
        return history.add_message(chat.id, "user", text)

    async def start_reply(self, resume: MessageRecord | None = None) -> None:
        """Generate the next reply, or with ``resume`` continue that interrupted one."""
        chat = self._ensure_chat()
        self.cancel = threading.Event()
        self.reply_view = None
        self.set_status(f"{self._model_line()} · {'continuing' if resume else 'generating'} (Esc stops)")
        self.buffer = ReplyBuffer()
        self.worker = self._generate(self.tandem.history.get_chat(chat.id), self.cancel, self.buffer, resume)

    @work(thread=True, group="generate", exclusive=True, exit_on_error=False)
    def _generate(self, chat: ChatRecord, cancel: threading.Event, buffer: ReplyBuffer,
                  resume: MessageRecord | None) -> None:
        try:
            record = run_reply(self.engine, self.tandem.history, chat, cancel=cancel,
                               on_token=lambda event, _n, live: buffer.push(event.text, live),
                               on_start=lambda r: self.post_message(ReplyStarted(r)),
                               model_name=self.choice.target_name,
                               drafter_name=self.choice.drafter_name, resume=resume)
            error = None
        except TandemError as exc:
            record, error = None, str(exc)
        except Exception as exc:  # a locked or full database, a native failure: never a wedged app
            record, error = None, f"The reply stopped: {failure_text(exc)}"
        self.post_message(ReplyDone(record, error))

    async def on_reply_started(self, message: ReplyStarted) -> None:
        record = message.record
        record.stats = {"model": self.choice.target_name, "drafter": self.choice.drafter_name}
        shown = [v for v in self.query(MessageView) if v.record.id == record.id]
        if shown:  # a continued reply: stream into the view that shows it
            view = shown[0]
            view.streaming = True
        else:
            view = self._view(record, streaming=True)
            await self.query_one("#messages").mount(view)
        self.reply_view = view  # only now: the drain timer may draw into it
        self.query_one("#messages", VerticalScroll).scroll_end(animate=False)

    async def _drain(self) -> None:
        """Draw what the worker has streamed since the last draw (runs on a timer).

        Drawing holds the GIL the worker needs between llama.cpp calls, so after a draw
        that took ``d`` seconds the next waits at least ``DRAW_DUTY * d``: the screen
        never takes more than about a fifth of the time from generation.
        """
        now = time.perf_counter()
        if self.reply_view is None or self._drawing.locked() or now < self._next_drain:
            return
        async with self._drawing:
            await self._draw(now)

    async def _draw(self, started: float) -> None:
        """One draw of what was streamed (the caller holds :attr:`_drawing`)."""
        update = self.buffer.drain()
        if update is None or self.reply_view is None:
            return
        try:
            await self.reply_view.append(*update)
        finally:
            self._next_drain = time.perf_counter() + DRAW_DUTY * (time.perf_counter() - started)
        box = self.query_one("#messages", VerticalScroll)
        if box.max_scroll_y - box.scroll_y < 4:
            box.scroll_end(animate=False)

    async def on_reply_done(self, message: ReplyDone) -> None:
        async with self._drawing:  # after a draw in progress, never before it
            await self._draw(time.perf_counter())
            view, self.reply_view = self.reply_view, None
        self.worker, self.cancel = None, None
        if message.error:
            self.notify(message.error, severity="error", timeout=12)
        if view is not None and message.record is not None:
            await view.finish(message.record)  # stored content, status and stats
        elif view is not None:  # failed mid-reply: keep what was shown, marked interrupted
            await view.finish(replace(view.record, status=INTERRUPTED))
        elif self.chat is not None:
            try:
                await self.open_chat(self.chat.id)
            except sqlite3.Error as exc:
                self.notify(f"The chat could not be reloaded ({failure_text(exc)}).", severity="error")
        self.set_status(self._model_line() + (f" · {message.error}" if message.error else ""))
        self.refresh_chat_list()
        self.query_one("#messages", VerticalScroll).scroll_end(animate=False)
        self.replies_done += 1

    async def stop_generation(self, wait: bool = False) -> None:
        """Cancel the running reply; with ``wait``, until its partial text is stored."""
        if self.cancel is not None:
            self.cancel.set()
        worker = self.worker
        if wait and worker is not None:
            await worker.wait()

    # -- actions -------------------------------------------------------------------
    async def action_stop(self) -> None:
        if self.generating:
            await self.stop_generation()
        elif self.editing is not None:
            self.editing = None
            self.query_one("#edit-banner").display = False
            self.input.clear()

    async def action_new_chat(self) -> None:
        if not self._busy():
            await self.open_chat(None)
            self.refresh_chat_list()
            self.input.focus()

    async def action_regenerate(self) -> None:
        if self._busy() or self.chat is None or self.engine is None:
            return
        messages = self.tandem.history.messages(self.chat.id)
        if not messages:
            return
        if messages[-1].role == "assistant":
            self.tandem.history.delete_from(self.chat.id, messages[-1].id)
            await self.open_chat(self.chat.id)
        await self.start_reply()

    def action_edit_last(self) -> None:
        if self._busy() or self.chat is None:
            return
        users = [m for m in self.tandem.history.messages(self.chat.id) if m.role == "user"]
        if not users:
            return
        self.editing = users[-1].id
        self.input.load_text(plain(users[-1].content))
        self.input.move_cursor(self.input.document.end)
        banner = self.query_one("#edit-banner", Label)
        banner.update("Editing your last message: Enter resends (later messages are replaced), Esc cancels")
        banner.display = True
        self.input.focus()

    @on(MessageView.CodeCopied)
    def _code_clicked(self, event: MessageView.CodeCopied) -> None:
        self._copy(event.code)
