"""The open chat's messages as one widget: how they are shown, and the reply keys act on.

The chat screen decides *which* messages are in the transcript (a chat opened, a reply
started); the transcript owns *how*: drafted tokens coloured or Markdown, ``<think>``
blocks shown or folded, timings masked for snapshots, following the end while a reply
streams, and which reply the copy keys mean.
"""

from __future__ import annotations

from collections.abc import Iterable

from textual import on
from textual.containers import VerticalScroll
from textual.widget import Widget

from tandem.app.history.database import MessageRecord
from tandem.app.tui.widgets import MessageView

FOLLOW_ROWS = 4
"""A reply being drawn keeps the view at its end while the user is within this many rows of it."""


class Transcript(VerticalScroll):
    """A scrolling column of :class:`MessageView`, oldest first."""

    def __init__(self, *, mask_timings: bool = False, id: str | None = None) -> None:
        super().__init__(id=id)
        self.mask_timings = mask_timings
        self.show_drafted = False
        """F4: colour the tokens the drafter wrote instead of rendering Markdown."""
        self.show_thinking = False
        """F3: unfold the replies' ``<think>`` blocks."""

    def views(self) -> list[MessageView]:
        return list(self.query(MessageView))

    def make_view(self, record: MessageRecord, streaming: bool = False) -> MessageView:
        """A view of ``record`` in the transcript's current modes."""
        return MessageView(record, mask_timings=self.mask_timings, show_drafted=self.show_drafted,
                           streaming=streaming, show_thinking=self.show_thinking)

    async def show(self, records: Iterable[MessageRecord] | None) -> None:
        """Replace what is shown with ``records`` (``None``: a new chat, nothing yet)."""
        await self.remove_children()
        if records is not None:
            await self.mount_all([self.make_view(m) for m in records])

    async def add(self, record: MessageRecord, streaming: bool = False) -> MessageView:
        """Show ``record`` after the others."""
        view = self.make_view(record, streaming=streaming)
        await self.mount(view)
        return view

    def find(self, message_id: int) -> MessageView | None:
        return next((v for v in self.views() if v.record.id == message_id), None)

    def follow(self) -> None:
        """After new text: stay at the end, unless the user scrolled up to read."""
        if self.max_scroll_y - self.scroll_y < FOLLOW_ROWS:
            self.scroll_end(animate=False)

    def reveal(self, message_id: int) -> None:
        """Focus the message and bring it to the top, once the transcript is laid out."""
        view = self.find(message_id)
        if view is not None:
            view.focus(scroll_visible=False)
            # after the refresh that lays an opened chat out (and runs its scroll to the end)
            self.call_after_refresh(self.scroll_to_widget, view, animate=False, top=True)

    # -- display modes ---------------------------------------------------------------
    def toggle_drafted(self) -> None:
        self.show_drafted = not self.show_drafted
        for view in self.views():
            view.set_show_drafted(self.show_drafted)
        self.notify("Drafted tokens coloured" if self.show_drafted else "Markdown view")

    def toggle_thinking(self) -> None:
        self.show_thinking = not self.show_thinking
        for view in self.views():
            view.set_show_thinking(self.show_thinking)
        self.notify("Thinking shown" if self.show_thinking else "Thinking hidden")

    # -- copying -----------------------------------------------------------------------
    def reply_view(self) -> MessageView | None:
        """"The reply" the copy keys act on: the focused message when it is a reply (Tab
        or a click focuses one), else the chat's last reply."""
        widget: Widget | None = self.screen.focused
        while widget is not None and not isinstance(widget, MessageView):
            widget = widget.parent if isinstance(widget.parent, Widget) else None
        if widget is not None and widget.record.role == "assistant":
            return widget
        replies = [v for v in self.views() if v.record.role == "assistant"]
        return replies[-1] if replies else None

    def copy_code(self) -> None:
        """Copy a code block: the reply's last, and on each press the one before it."""
        view = self.reply_view()
        if view is None or not view.code_blocks():
            replies = [v for v in self.views() if v.record.role == "assistant" and v.code_blocks()]
            view = replies[-1] if replies else None
        found = view.next_code_block() if view is not None else None
        if view is None or found is None:
            self.notify("No code block to copy.", severity="warning")
            return
        index, code = found
        self.app.copy_to_clipboard(code)
        self.notify(f"Copied code block {index + 1} of {len(view.code_blocks())} "
                    f"({len(code.splitlines())} lines); F5 again: the one before")

    def copy_reply(self) -> None:
        view = self.reply_view()
        if view is None or not view.answer.strip():
            self.notify("No reply to copy.", severity="warning")
            return
        self.app.copy_to_clipboard(view.answer)
        self.notify(f"Copied the reply ({len(view.answer.splitlines())} lines)")

    @on(MessageView.CodeCopied)
    def _code_clicked(self, event: MessageView.CodeCopied) -> None:
        self.app.copy_to_clipboard(event.code)
        self.notify(f"Copied code block ({len(event.code.splitlines())} lines)")
