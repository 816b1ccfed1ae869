"""The main screen: chat list, messages, input; every chat action is a keyboard binding.

The screen holds the open chat and composes the widgets; each other job is a
collaborator it creates and hands what that job needs: :class:`ModelLoader` (the engine,
loaded behind a progress line), :class:`ReplyStream` (one reply's worker and its
throttled drawing), :class:`Transcript` (the messages widget: display modes, copying)
and :class:`ChatActions` (the dialogs). Textual finds bindings, actions and message
handlers here; they delegate. Quitting waits for a running reply to store its partial
text before the app exits.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

from textual import events, on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer, Header, Label, OptionList

from tandem.app.history.database import INTERRUPTED, ChatRecord, History, MessageRecord
from tandem.app.tui.autocomplete_screen import open_autocomplete
from tandem.app.tui.chat_actions import ChatActions
from tandem.app.tui.model_choice import ModelChoice, engine_record
from tandem.app.tui.model_loading import EngineReady, ModelLoader
from tandem.app.tui.reply_stream import ReplyDone, ReplyStarted, ReplyStream, failure_text
from tandem.app.tui.session import ChatSettings, title_from
from tandem.app.tui.shown import plain, shown
from tandem.app.tui.transcript import Transcript
from tandem.app.tui.widgets import ChatInput, ChatList, MessageView


class ChatScreen(Screen):
    """One chat at a time beside the list of all of them; the keys act on the open chat."""

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

    def __init__(self, choice: ModelChoice, history: History, settings: ChatSettings, *,
                 export_dir: Path, mask_timings: bool = False) -> None:
        """``settings``: what new chats start with; ``export_dir``: where exports go by
        default; ``mask_timings``: ``--`` for wall-clock figures (deterministic snapshots)."""
        super().__init__()
        self.history = history
        self.new_chat_settings = settings
        self.chat: ChatRecord | None = None
        self.editing: int | None = None
        """The user message being edited (Ctrl+E): sending replaces it and what follows."""
        self.replies_done = 0
        """Replies finished (or stopped) on this screen: tests wait on it."""
        self.transcript = Transcript(mask_timings=mask_timings, id="messages")
        self.loader = ModelLoader(self, choice, self.set_status)
        self.replies = ReplyStream(self, history, self.transcript)
        self.actions = ChatActions(self, history, self.loader, self.transcript, export_dir)

    @property
    def engine(self) -> Any:
        """The engine replies use (``None`` while a model loads); tests may wrap it."""
        return self.loader.engine

    @engine.setter
    def engine(self, engine: Any) -> None:
        self.loader.engine = engine

    @property
    def choice(self) -> ModelChoice:
        return self.loader.choice

    @property
    def generating(self) -> bool:
        return self.replies.running

    @property
    def input(self) -> ChatInput:
        return self.query_one("#input", ChatInput)

    def call_from_thread(self, callback: Callable[..., Any], *args: Any) -> Any:
        """For the workers of :attr:`loader` and :attr:`replies` (:class:`WorkerHost`)."""
        return self.app.call_from_thread(callback, *args)

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False, icon="≈")
        with Horizontal():
            with Vertical(id="sidebar"):
                yield Label("Chats", classes="sidebar-title")
                yield ChatList(id="chat-list")
            with Vertical(id="main"):
                yield self.transcript
                yield Label("", id="edit-banner")
                yield ChatInput(id="input", placeholder="Message (Enter sends, Ctrl+J newline)")
                yield Label("", id="status")
        yield Footer(compact=True, show_command_palette=False)

    async def on_mount(self) -> None:
        self.query_one("#edit-banner").display = False
        chats = self.history.list_chats()
        self.refresh_chat_list()
        if chats:
            await self.open_chat(chats[0].id)
        else:
            self.sub_title = "New chat"
        self.input.focus()
        self.loader.load(self.loader.choice, after_paint=True)  # the input box first, then the runtime
        self.set_interval(1 / 15, self.replies.drain)
        self.set_interval(1.0, self.loader.tick)

    def set_status(self, text: str) -> None:
        self.query_one("#status", Label).update(shown(text))

    # -- chats --------------------------------------------------------------------
    def refresh_chat_list(self) -> None:
        chats = self.history.list_chats()
        self.query_one("#chat-list", ChatList).set_chats(chats, self.chat.id if self.chat else None)

    async def open_chat(self, chat_id: int | None) -> None:
        self.chat = self.history.get_chat(chat_id) if chat_id is not None else None
        self.editing = None
        self.query_one("#edit-banner").display = False
        await self.transcript.show(self.history.messages(self.chat.id) if self.chat is not None else None)
        self.sub_title = plain(self.chat.title) if self.chat else "New chat"
        self.transcript.scroll_end(animate=False)

    async def switch_to(self, chat_id: int | None) -> None:
        """Open another chat with the models it last used (:class:`ChatHost`)."""
        await self.open_chat(chat_id)
        self.refresh_chat_list()
        self.loader.restore(self.chat)

    def show_chat(self, chat: ChatRecord) -> None:
        """The open chat's record changed (renamed, new settings): :class:`ChatHost`."""
        self.chat = chat
        self.sub_title = plain(chat.title)
        self.refresh_chat_list()

    def ensure_chat(self) -> ChatRecord:
        """The open chat, stored first when it is a new one (:class:`ChatHost`)."""
        if self.chat is None:
            self.chat = self.history.create_chat(
                params=self.new_chat_settings.to_dict(),
                model=self.choice.target_name, drafter=self.choice.drafter_name)
        return self.chat

    def busy(self) -> bool:
        """A reply is running (the user is told so): chat changes wait for it."""
        if self.generating:
            self.notify("A reply is being generated: press Esc to stop it first.", severity="warning")
        return self.generating

    @on(OptionList.OptionSelected, "#chat-list")
    async def _chat_selected(self, event: OptionList.OptionSelected) -> None:
        if not self.busy() and event.option.id is not None:
            await self.open_chat(int(event.option.id))
            self.loader.restore(self.chat)
            self.input.focus()

    # -- sending and generation ----------------------------------------------------
    @on(ChatInput.Submitted)
    async def _submitted(self, event: ChatInput.Submitted) -> None:
        await self.send(event.text)

    async def send(self, text: str) -> None:
        if self.busy():
            return
        if self.engine is None and not self.loader.loading:
            self.notify("No model is loaded (it failed to load): choose one with Ctrl+T.", severity="warning")
            return
        try:
            record = await self._store_user_message(text)
        except sqlite3.Error as exc:  # the typed text stays in the input: nothing is lost
            self.notify(f"Your message could not be saved ({failure_text(exc)}); it is still in the input. "
                        "Try again when the disk or the database is free.", severity="error", timeout=12)
            return
        self.input.clear()
        await self.transcript.add(record)
        self.refresh_chat_list()
        if self.engine is None:  # still loading: answered as soon as the model is ready
            self.loader.queue(record.chat_id)
            return
        await self.start_reply()

    async def _store_user_message(self, text: str) -> MessageRecord:
        history = self.history
        if self.editing is not None and self.chat is not None:
            history.delete_from(self.chat.id, self.editing)
            await self.open_chat(self.chat.id)
        chat = self.ensure_chat()
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
        chat = self.ensure_chat()
        self.set_status(f"{self.loader.model_line()} · {'continuing' if resume else 'generating'} (Esc stops)")
        self.replies.start(self.engine, self.history.get_chat(chat.id), self.choice, resume)

    async def on_reply_started(self, message: ReplyStarted) -> None:
        await self.replies.started(message.record)

    async def on_reply_done(self, message: ReplyDone) -> None:
        view = await self.replies.finish(message)
        if view is None and self.chat is not None:  # nothing was shown: show what was stored
            try:
                await self.open_chat(self.chat.id)
            except sqlite3.Error as exc:
                self.notify(f"The chat could not be reloaded ({failure_text(exc)}).", severity="error")
        self.set_status(self.loader.model_line() + (f" · {message.error}" if message.error else ""))
        self.refresh_chat_list()
        self.transcript.scroll_end(animate=False)
        self.replies_done += 1

    async def on_engine_ready(self, message: EngineReady) -> None:
        queued = self.loader.ready(message)
        if queued is not None and self.chat is not None and self.chat.id == queued and not self.generating:
            await self.start_reply()

    async def stop_generation(self, wait: bool = False) -> None:
        """Cancel the running reply; with ``wait``, until its partial text is stored."""
        await self.replies.stop(wait)

    def on_key(self, event: events.Key) -> None:
        """Typing while a message is focused (after a search jump, or Tab) writes in the
        input box: focusing a message to copy it must not swallow the next words."""
        if isinstance(self.focused, MessageView) and event.is_printable and event.character:
            event.stop()
            self.input.focus()
            self.input.insert(event.character)

    # -- actions -------------------------------------------------------------------
    async def action_stop(self) -> None:
        if self.generating:
            await self.stop_generation()
        elif self.editing is not None:
            self.editing = None
            self.query_one("#edit-banner").display = False
            self.input.clear()

    async def action_new_chat(self) -> None:
        if not self.busy():
            await self.open_chat(None)
            self.refresh_chat_list()
            self.input.focus()

    async def action_regenerate(self) -> None:
        if self.busy() or self.chat is None or self.engine is None:
            return
        messages = self.history.messages(self.chat.id)
        if not messages:
            return
        if messages[-1].role == "assistant":
            self.history.delete_from(self.chat.id, messages[-1].id)
            await self.open_chat(self.chat.id)
        await self.start_reply()

    async def action_continue_reply(self) -> None:
        """Continue the chat's last reply when it was interrupted (Esc, a crash, quitting)."""
        if self.busy() or self.chat is None:
            return
        if self.engine is None:
            self.notify("The model is still loading (or failed to load).", severity="warning")
            return
        messages = self.history.messages(self.chat.id)
        last = messages[-1] if messages else None
        if last is None or last.role != "assistant" or last.status != INTERRUPTED:
            self.notify("Only an interrupted last reply can be continued.", severity="warning")
            return
        await self.start_reply(resume=last)

    def action_edit_last(self) -> None:
        if self.busy() or self.chat is None:
            return
        users = [m for m in self.history.messages(self.chat.id) if m.role == "user"]
        if not users:
            return
        self.editing = users[-1].id
        self.input.load_text(plain(users[-1].content))
        self.input.move_cursor(self.input.document.end)
        banner = self.query_one("#edit-banner", Label)
        banner.update("Editing your last message: Enter resends (later messages are replaced), Esc cancels")
        banner.display = True
        self.input.focus()

    def action_toggle_sidebar(self) -> None:
        sidebar = self.query_one("#sidebar")
        sidebar.display = not sidebar.display

    def action_settings(self) -> None:
        self.actions.settings()

    def action_models(self) -> None:
        if not self.busy():
            self.actions.pick_models()

    def action_search(self) -> None:
        if not self.busy():
            self.actions.search()

    def action_export(self) -> None:
        self.actions.export()

    def action_rename(self) -> None:
        self.actions.rename()

    def action_delete_chat(self) -> None:
        if not self.busy():
            self.actions.delete()

    def action_help(self) -> None:
        self.actions.help(self.BINDINGS)

    def action_copy_code(self) -> None:
        self.transcript.copy_code()

    def action_copy_reply(self) -> None:
        self.transcript.copy_reply()

    def action_toggle_thinking(self) -> None:
        self.transcript.toggle_thinking()

    def action_toggle_drafted(self) -> None:
        self.transcript.toggle_drafted()

    def action_autocomplete(self) -> None:
        """F9 / Ctrl+Space: the autocomplete pane (:mod:`tandem.app.tui.autocomplete_screen`)."""
        open_autocomplete(self.engine, self.input)
