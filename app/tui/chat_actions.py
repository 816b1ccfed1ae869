"""The chat screen's dialogs: settings, models, export, rename, delete, search, help.

:class:`ChatActions` opens each dialog and applies its answer to the history; what the
answer changes on screen goes through :class:`ChatHost`, the part of the chat screen
these actions use. Everything here runs on the UI thread.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from textual.binding import Binding, BindingType
from textual.notifications import SeverityLevel
from textual.screen import Screen

from tandem.app.history.database import ChatRecord, History
from tandem.app.tui.modals import Confirm, HelpScreen, ModelPicker, SettingsScreen, TextPrompt
from tandem.app.tui.model_loading import ModelLoader
from tandem.app.tui.search_dialog import SearchScreen
from tandem.app.tui.session import ChatSettings
from tandem.app.tui.shown import plain
from tandem.app.tui.transcript import Transcript
from tandem.app.tui.widgets import NEWLINE_KEYS
from tandem.models.store import ModelEntry, file_identity, list_models


class DialogStack(Protocol):
    """Where dialogs open: the app's screen stack."""

    def push_screen(self, screen: Screen[Any], callback: Callable[[Any], Any] | None = None) -> Any:
        ...


class ChatHost(Protocol):
    """The chat screen as its dialogs see it: the open chat, and how to show another."""

    @property
    def app(self) -> DialogStack: ...

    @property
    def chat(self) -> ChatRecord | None: ...

    def ensure_chat(self) -> ChatRecord:
        """The open chat, created (and stored) first when it is a new one."""
        ...

    def show_chat(self, chat: ChatRecord) -> None:
        """The open chat's record changed (title, settings): keep and show it."""
        ...

    async def switch_to(self, chat_id: int | None) -> None:
        """Open another chat (``None``: a new one) with the models it last used."""
        ...

    def notify(self, message: str, *, title: str = "", severity: SeverityLevel = "information",
               timeout: float | None = None, markup: bool = True) -> None: ...


def with_current(entries: list[ModelEntry], current: list[Path | None]) -> list[ModelEntry]:
    """The store's models plus the ones in use that it does not hold (given by path with
    ``-m FILE``), so the picker always lists the current target and drafter."""
    known = {file_identity(e.path) for e in entries if e.path.exists()}
    extra = []
    for path in current:
        if path is None or not path.exists() or file_identity(path) in known:
            continue
        known.add(file_identity(path))
        size = path.stat().st_size if path.is_file() else 0
        extra.append(ModelEntry(path.stem, path, size, None, "given"))
    return extra + entries


def help_text(bindings: Sequence[BindingType]) -> str:
    """F1's page: every key of ``bindings`` with its full description, and the basics."""
    rows = [f"| `{b.key.replace(',', ' / ')}` | {b.tooltip or b.description} |"
            for b in bindings if isinstance(b, Binding)]
    newline = ", ".join(f"`{k}`" for k in NEWLINE_KEYS)
    return "\n".join([
        "# Tandem chat: keys", "",
        f"Type in the box at the bottom. **Enter** sends; {newline} insert a newline.",
        "The mouse works too: click a chat to open it, click a code block to copy it,",
        "drag to select text. `ctrl+p` opens the command palette (themes), `ctrl+q` quits.",
        "The footer shows the common keys; this table lists them all.",
        "", "| Key | Action |", "|---|---|", *rows, "",
        "Replies keep their stats: time to first token, tokens/s, acceptance rate and",
        "tokens per target call when a drafter is on, memory of target, drafter and KV cache.",
    ])


class ChatActions:
    """Dialogs on the open chat; ``host`` shows what their answers change."""

    def __init__(self, host: ChatHost, history: History, loader: ModelLoader, transcript: Transcript,
                 export_dir: Path) -> None:
        self.host, self.history, self.loader = host, history, loader
        self.transcript, self.export_dir = transcript, export_dir

    def settings(self) -> None:
        """System prompt and sampling of the open chat (created first if new)."""
        chat = self.host.ensure_chat()
        settings = ChatSettings.from_dict(chat.params)

        def done(result: tuple[str, ChatSettings] | None) -> None:
            if result is not None and self.host.chat is not None:
                self.host.show_chat(self.history.update_chat(
                    self.host.chat.id, system_prompt=result[0], params=result[1].to_dict()))
                self.host.notify("Chat settings saved")

        self.host.app.push_screen(SettingsScreen(chat.system_prompt, settings), done)

    def pick_models(self) -> None:
        """Model and drafter: the picker's answer is loaded in place of the current ones."""
        choice = self.loader.choice
        entries = with_current(list_models(), [choice.target, choice.drafter])

        def done(result: tuple[Path, Path | None] | None) -> None:
            if result is not None:
                self.loader.load(self.loader.choice.with_models(result[0], result[1]))

        # the speculative runtime is always installed now (runtime/engine/ builds every engine)
        self.host.app.push_screen(ModelPicker(entries, choice.target, choice.drafter, True), done)

    def export(self) -> None:
        """The open chat as Markdown, to a file the user names (the export folder's by default)."""
        chat = self.host.chat
        if chat is None:
            self.host.notify("Nothing to export yet.", severity="warning")
            return
        slug = re.sub(r"[^A-Za-z0-9]+", "-", plain(chat.title)).strip("-").lower() or "chat"
        default = self.export_dir / f"{slug}-{chat.id}.md"

        def done(path: str | None) -> None:
            if path is None:
                return
            target = Path(path).expanduser()
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(self.history.export_markdown(chat.id), encoding="utf-8")
            except OSError as exc:
                self.host.notify(f"Could not write {target}: {exc.strerror or exc}", severity="error")
                return
            self.host.notify(f"Exported to {target}")

        self.host.app.push_screen(TextPrompt("Export chat to Markdown file", str(default)), done)

    def rename(self) -> None:
        chat = self.host.chat
        if chat is None:
            return

        def done(title: str | None) -> None:
            if title and self.host.chat is not None:
                self.host.show_chat(self.history.update_chat(self.host.chat.id, title=title))

        self.host.app.push_screen(TextPrompt("Rename chat", plain(chat.title)), done)

    def delete(self) -> None:
        """Delete the open chat after a confirmation; the most recent other one opens."""
        chat = self.host.chat
        if chat is None:
            return

        async def done(yes: bool | None) -> None:
            if yes:
                self.history.delete_chat(chat.id)
                chats = self.history.list_chats()
                await self.host.switch_to(chats[0].id if chats else None)
                self.host.notify(f"Deleted “{chat.title}”")

        self.host.app.push_screen(Confirm(f"Delete “{chat.title}” and all its messages?"), done)

    def search(self) -> None:
        """Search every chat; a chosen hit opens its chat at that message."""

        async def done(hit: tuple[int, int] | None) -> None:
            if hit is not None:
                await self.jump_to(*hit)

        self.host.app.push_screen(SearchScreen(self.history), done)

    async def jump_to(self, chat_id: int, message_id: int) -> None:
        """Open the chat holding a search hit and bring the message into view, focused."""
        chat = self.host.chat
        if chat is None or chat.id != chat_id:
            await self.host.switch_to(chat_id)
        self.transcript.reveal(message_id)

    def help(self, bindings: Sequence[BindingType]) -> None:
        self.host.app.push_screen(HelpScreen(help_text(bindings)))
