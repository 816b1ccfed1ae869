"""The chat screen's dialog actions: settings, models, export, rename, delete, copy, help.

A mixin so ``chat_screen.py`` stays about the conversation and its generation worker;
every method here runs on the UI thread and only touches the history and dialogs.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from textual.binding import Binding

from tandem.app.tui.autocomplete import open_autocomplete
from tandem.app.tui.modals import Confirm, HelpScreen, ModelPicker, SettingsScreen, TextPrompt
from tandem.app.tui.session import ChatSettings
from tandem.app.tui.shown import plain
from tandem.app.tui.widgets import NEWLINE_KEYS, MessageView
from tandem.models.store import ModelEntry, file_identity, list_models

if TYPE_CHECKING:
    from tandem.app.tui.chat_screen import ChatScreen

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


class ChatActions:
    """Mixed into :class:`ChatScreen` (``self`` is the screen)."""

    BINDINGS: Any
    show_drafted: bool

    def action_settings(self: ChatScreen) -> None:
        chat = self._ensure_chat()
        settings = ChatSettings.from_dict(chat.params)

        def done(result: tuple[str, ChatSettings] | None) -> None:
            if result is not None and self.chat is not None:
                self.chat = self.tandem.history.update_chat(
                    self.chat.id, system_prompt=result[0], params=result[1].to_dict())
                self.refresh_chat_list()
                self.notify("Chat settings saved")

        self.app.push_screen(SettingsScreen(chat.system_prompt, settings), done)

    def action_models(self: ChatScreen) -> None:
        if self._busy():
            return
        entries = with_current(list_models(), [self.choice.target, self.choice.drafter])

        def done(result: tuple[Path, Path | None] | None) -> None:
            if result is not None:
                self.load_model(self.choice.with_models(result[0], result[1]))

        # the speculative runtime is always installed now (runtime/engine.py builds every engine)
        self.app.push_screen(ModelPicker(entries, self.choice.target, self.choice.drafter, True), done)

    def action_export(self: ChatScreen) -> None:
        if self.chat is None:
            self.notify("Nothing to export yet.", severity="warning")
            return
        slug = re.sub(r"[^A-Za-z0-9]+", "-", plain(self.chat.title)).strip("-").lower() or "chat"
        default = self.tandem.config.export_dir / f"{slug}-{self.chat.id}.md"
        chat_id = self.chat.id

        def done(path: str | None) -> None:
            if path is None:
                return
            target = Path(path).expanduser()
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(self.tandem.history.export_markdown(chat_id), encoding="utf-8")
            except OSError as exc:
                self.notify(f"Could not write {target}: {exc.strerror or exc}", severity="error")
                return
            self.notify(f"Exported to {target}")

        self.app.push_screen(TextPrompt("Export chat to Markdown file", str(default)), done)

    def action_rename(self: ChatScreen) -> None:
        if self.chat is None:
            return

        def done(title: str | None) -> None:
            if title and self.chat is not None:
                self.chat = self.tandem.history.update_chat(self.chat.id, title=title)
                self.sub_title = plain(title)
                self.refresh_chat_list()

        self.app.push_screen(TextPrompt("Rename chat", plain(self.chat.title)), done)

    def action_delete_chat(self: ChatScreen) -> None:
        if self._busy() or self.chat is None:
            return
        chat = self.chat

        async def done(yes: bool | None) -> None:
            if yes:
                self.tandem.history.delete_chat(chat.id)
                chats = self.tandem.history.list_chats()
                await self.open_chat(chats[0].id if chats else None)
                self.restore_model()
                self.refresh_chat_list()
                self.notify(f"Deleted “{chat.title}”")

        self.app.push_screen(Confirm(f"Delete “{chat.title}” and all its messages?"), done)

    def action_toggle_drafted(self: ChatScreen) -> None:
        self.show_drafted = not self.show_drafted
        for view in self.query(MessageView):
            view.set_show_drafted(self.show_drafted)
        self.notify("Drafted tokens coloured" if self.show_drafted else "Markdown view")

    def action_toggle_sidebar(self: ChatScreen) -> None:
        sidebar = self.query_one("#sidebar")
        sidebar.display = not sidebar.display

    def action_autocomplete(self: ChatScreen) -> None:
        """F9 / Ctrl+Space: the autocomplete pane (:mod:`tandem.app.tui.autocomplete`)."""
        open_autocomplete(self)

    def action_help(self: ChatScreen) -> None:
        rows = [f"| `{b.key.replace(',', ' / ')}` | {b.tooltip or b.description} |"
                for b in self.BINDINGS if isinstance(b, Binding)]
        newline = ", ".join(f"`{k}`" for k in NEWLINE_KEYS)
        text = "\n".join([
            "# Tandem chat: keys", "",
            f"Type in the box at the bottom. **Enter** sends; {newline} insert a newline.",
            "The mouse works too: click a chat to open it, click a code block to copy it,",
            "drag to select text. `ctrl+p` opens the command palette (themes), `ctrl+q` quits.",
            "The footer shows the common keys; this table lists them all.",
            "", "| Key | Action |", "|---|---|", *rows, "",
            "Replies keep their stats: time to first token, tokens/s, acceptance rate and",
            "tokens per target call when a drafter is on, memory of target, drafter and KV cache.",
        ])
        self.app.push_screen(HelpScreen(text))
