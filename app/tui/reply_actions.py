"""The chat screen's actions on replies: copy, continue, thinking, and search across chats.

A mixin like :mod:`chat_actions`, so ``chat_screen.py`` stays about the conversation and
its worker. "The reply" these act on is the focused message when it is a reply (Tab or
a click focuses one), else the last reply of the chat.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual import events
from textual.containers import VerticalScroll
from textual.widget import Widget

from tandem.app.history.store import INTERRUPTED
from tandem.app.tui.search import SearchScreen
from tandem.app.tui.widgets import MessageView

if TYPE_CHECKING:
    from tandem.app.tui.chat_screen import ChatScreen


class ReplyActions:
    """Mixed into :class:`ChatScreen` (``self`` is the screen)."""

    show_thinking: bool = False

    def _reply_view(self: ChatScreen) -> MessageView | None:
        widget: Widget | None = self.focused
        while widget is not None and not isinstance(widget, MessageView):
            widget = widget.parent if isinstance(widget.parent, Widget) else None
        if widget is not None and widget.record.role == "assistant":
            return widget
        replies = [v for v in self.query(MessageView) if v.record.role == "assistant"]
        return replies[-1] if replies else None

    def action_copy_code(self: ChatScreen) -> None:
        """Copy a code block: the reply's last, and on each press the one before it."""
        view = self._reply_view()
        if view is None or not view.code_blocks():
            replies = [v for v in self.query(MessageView) if v.record.role == "assistant" and v.code_blocks()]
            view = replies[-1] if replies else None
        found = view.next_code_block() if view is not None else None
        if found is None:
            self.notify("No code block to copy.", severity="warning")
            return
        index, code = found
        self.app.copy_to_clipboard(code)
        self.notify(f"Copied code block {index + 1} of {len(view.code_blocks())} "
                    f"({len(code.splitlines())} lines); F5 again: the one before")

    def _copy(self: ChatScreen, code: str) -> None:
        self.app.copy_to_clipboard(code)
        self.notify(f"Copied code block ({len(code.splitlines())} lines)")

    def action_copy_reply(self: ChatScreen) -> None:
        view = self._reply_view()
        if view is None or not view.answer.strip():
            self.notify("No reply to copy.", severity="warning")
            return
        self.app.copy_to_clipboard(view.answer)
        self.notify(f"Copied the reply ({len(view.answer.splitlines())} lines)")

    def action_toggle_thinking(self: ChatScreen) -> None:
        self.show_thinking = not self.show_thinking
        for view in self.query(MessageView):
            view.set_show_thinking(self.show_thinking)
        self.notify("Thinking shown" if self.show_thinking else "Thinking hidden")

    async def action_continue_reply(self: ChatScreen) -> None:
        """Continue the chat's last reply when it was interrupted (Esc, a crash, quitting)."""
        if self._busy() or self.chat is None:
            return
        if self.engine is None:
            self.notify("The model is still loading (or failed to load).", severity="warning")
            return
        messages = self.tandem.history.messages(self.chat.id)
        last = messages[-1] if messages else None
        if last is None or last.role != "assistant" or last.status != INTERRUPTED:
            self.notify("Only an interrupted last reply can be continued.", severity="warning")
            return
        await self.start_reply(resume=last)

    def action_search(self: ChatScreen) -> None:
        if self._busy():
            return

        async def done(hit: tuple[int, int] | None) -> None:
            if hit is not None:
                await self.jump_to(*hit)

        self.app.push_screen(SearchScreen(self.tandem.history), done)

    def on_key(self: ChatScreen, event: events.Key) -> None:
        """Typing while a message is focused (after a search jump, or Tab) writes in the
        input box: focusing a message to copy it must not swallow the next words."""
        if isinstance(self.focused, MessageView) and event.is_printable and event.character:
            event.stop()
            self.input.focus()
            self.input.insert(event.character)

    async def jump_to(self: ChatScreen, chat_id: int, message_id: int) -> None:
        """Open the chat holding a search hit and bring the message into view, focused."""
        if self.chat is None or self.chat.id != chat_id:
            await self.open_chat(chat_id)
            self.refresh_chat_list()
            self.restore_model()
        box = self.query_one("#messages", VerticalScroll)
        for view in self.query(MessageView):
            if view.record.id == message_id:
                view.focus(scroll_visible=False)
                # after the refresh that lays the opened chat out (and runs its scroll to the end)
                self.call_after_refresh(box.scroll_to_widget, view, animate=False, top=True)
                return
