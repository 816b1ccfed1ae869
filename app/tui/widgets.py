"""Widgets of the chat screen: the input box, one message with its stats, the chat list."""

from __future__ import annotations

from typing import Any

from markdown_it import MarkdownIt
from markdown_it.rules_core import StateCore
from rich.text import Text
from textual import events, on
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Collapsible, Label, Markdown, OptionList, Static, TextArea
from textual.widgets.markdown import MarkdownFence
from textual.widgets.option_list import Option

from tandem.app.history.database import INTERRUPTED, ChatRecord, MessageRecord
from tandem.app.terminal_text import mask_controls, strip_controls
from tandem.app.tui.shown import shown
from tandem.app.tui.thinking import Split, split_thinking, thinking_title

NEWLINE_KEYS = ("shift+enter", "ctrl+j", "alt+enter")
"""Keys that insert a newline in the input; plain Enter sends. Ctrl+J works in every terminal."""


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"  # pragma: no cover


def decode_speed_known(stats: dict[str, Any]) -> bool:
    """Tokens/s is measured over the tokens after the first: with one token (or a stored
    0.0 from older replies) there is no decode time, so no speed to show."""
    return stats.get("generated_tokens", 0) > 1 and bool(stats.get("tokens_per_s"))


def format_stats(stats: dict[str, Any] | None, *, mask_timings: bool = False) -> str:
    """One line of reply stats. ``mask_timings`` hides wall-clock figures (snapshot tests)."""
    if not stats:
        return ""
    if stats.get("error"):
        return f"error: {stats['error']}"
    parts: list[str] = []

    if "ttft_s" in stats:
        parts.append(f"TTFT {'--' if mask_timings else format(stats['ttft_s'] * 1000, '.0f')} ms")
    if decode_speed_known(stats):
        parts.append(f"{'--' if mask_timings else format(stats['tokens_per_s'], '.1f')} tok/s")
    parts.append(f"{stats.get('generated_tokens', 0)} tokens")
    if stats.get("acceptance_rate") is not None:
        parts.append(f"accept {stats['acceptance_rate'] * 100:.0f}%")
    if stats.get("drafted_tokens"):
        parts.append(f"{stats.get('tokens_per_call', 0):.2f} tok/call")
    elif stats.get("drafted_share"):
        parts.append(f"drafted {stats['drafted_share'] * 100:.0f}%")
    memory = stats.get("memory") or {}
    if memory:
        mem = f"target {human_bytes(memory.get('target', 0))}"
        if memory.get("drafter"):
            mem += f" + drafter {human_bytes(memory['drafter'])}"
        elif "drafter" in memory and stats.get("drafter"):  # a model not asked for a draft yet: it loads then
            mem += " + drafter not loaded"
        mem += f" + KV {human_bytes(memory.get('kv', 0))}"
        parts.append(mem)
    reason = stats.get("finish_reason")
    if reason and reason not in ("stop",):
        parts.append(reason)
    if stats.get("live"):
        parts.append("streaming…")
    return " · ".join(parts)


def hard_breaks(state: StateCore) -> None:
    """Turn every soft line break into a hard one.

    Chat models write poems, addresses and step lists with single newlines and mean
    them: CommonMark would join such lines into one paragraph line.
    """
    for token in state.tokens:
        for child in token.children or ():
            if child.type == "softbreak":
                child.type = "hardbreak"


def chat_markdown_parser() -> MarkdownIt:
    """The GFM-like parser Textual uses, keeping single newlines as line breaks."""
    parser = MarkdownIt("gfm-like")
    parser.core.ruler.push("hard_breaks", hard_breaks)
    return parser


def drafted_text(content: str, spans: list[list[int]], style: str) -> Text:
    """The reply as plain text with the characters that came from the drafter styled."""
    text = Text(mask_controls(content))  # same length: the spans still line up
    for start, end in spans:
        text.stylize(style, start, end)
    return text


class ChatInput(TextArea):
    """Multi-line input: Enter sends, Shift+Enter / Ctrl+J / Alt+Enter insert a newline."""

    class Submitted(Message):
        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            if self.text.strip():
                self.post_message(self.Submitted(self.text))
            return
        if event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        await super()._on_key(event)


class MessageView(Vertical):
    """One message: a role line, the Markdown body and, for replies, a stats line."""

    can_focus = True

    class CodeCopied(Message):
        def __init__(self, code: str) -> None:
            super().__init__()
            self.code = code

    def __init__(self, record: MessageRecord, *, mask_timings: bool = False,
                 show_drafted: bool = False, streaming: bool = False, show_thinking: bool = False) -> None:
        super().__init__(classes=f"message {record.role}")
        self.record = record
        self.mask_timings = mask_timings
        self.show_drafted = show_drafted
        self.show_thinking = show_thinking
        self.streaming = streaming
        self._spans: list[list[int]] = list((record.stats or {}).get("drafted_spans", []))
        self._split = self._split_content()
        self._code_index: int | None = None
        """Which code block F5 copied last (it steps back through the blocks)."""

    @property
    def answer(self) -> str:
        """The reply without its thinking block: what Markdown shows and F6 copies."""
        return self._split.answer

    def _split_content(self) -> Split:
        content = strip_controls(self.record.content)  # shown, not stored: no escapes reach the terminal
        if self.record.role != "assistant":
            return Split(None, content, True)
        return split_thinking(content)

    def compose(self) -> ComposeResult:
        yield Label(shown(self._role_line()), classes="role")
        split = self._split
        with Collapsible(title=thinking_title(split), collapsed=not self.show_thinking, classes="thinking"):
            yield Static(split.thinking or "", classes="thinking-text", markup=False)
        yield Markdown(split.answer, classes="body", parser_factory=chat_markdown_parser)
        yield Static(drafted_text(self.record.content, self._spans, self._drafted_style()),
                     classes="drafted", markup=False)
        yield Static(shown(self._stats_line()), classes="stats", markup=False)

    def on_mount(self) -> None:
        self._apply_mode()

    def _role_line(self) -> str:
        role = {"user": "You", "assistant": "Assistant", "system": "System"}.get(self.record.role, str(self.record.role))
        model = (self.record.stats or {}).get("model")
        if self.record.role == "assistant" and model:
            role += f" · {model}"
            drafter = (self.record.stats or {}).get("drafter")
            if drafter:
                role += f" + {drafter}"
        if self.record.status == INTERRUPTED and not self.streaming:
            role += " · interrupted"
        return role

    def _stats_line(self) -> str:
        if self.record.role != "assistant":
            return ""
        return format_stats(self.record.stats, mask_timings=self.mask_timings)

    def _apply_mode(self) -> None:
        coloured = self.show_drafted and self.record.role == "assistant"
        self.query_one(".thinking", Collapsible).display = self._split.thinking is not None and not coloured
        self.query_one(".body", Markdown).display = not coloured
        self.query_one(".drafted", Static).display = coloured
        self.query_one(".stats", Static).display = self.record.role == "assistant"

    def set_show_drafted(self, value: bool) -> None:
        self.show_drafted = value
        self._refresh_drafted()
        self._apply_mode()

    def _drafted_style(self) -> str:
        return f"bold {self.app.current_theme.accent or 'magenta'}"

    def _refresh_drafted(self) -> None:
        if self.show_drafted:
            self.query_one(".drafted", Static).update(
                drafted_text(self.record.content, self._spans, self._drafted_style()))

    def set_show_thinking(self, value: bool) -> None:
        self.show_thinking = value
        self.query_one(".thinking", Collapsible).collapsed = not value

    async def _show_split(self) -> None:
        """Draw the current content: thinking into its block, the answer as Markdown.

        ``Markdown.append`` re-parses only the last block, so while the answer grows
        earlier blocks are not redrawn (no flicker); anything else is a full update.
        """
        old, self._split = self._split, self._split_content()
        new = self._split
        if new.thinking is not None:
            block = self.query_one(".thinking", Collapsible)
            block.title = thinking_title(new)
            if new.thinking != old.thinking:
                self.query_one(".thinking-text", Static).update(new.thinking)
        if (new.thinking is None) != (old.thinking is None):
            self._apply_mode()
        body = self.query_one(".body", Markdown)
        if new.answer.startswith(old.answer) and body.source == old.answer:
            if len(new.answer) > len(old.answer):
                await body.append(new.answer[len(old.answer):])
        elif body.source != new.answer:
            await body.update(new.answer)

    async def append(self, text: str, spans: list[list[int]], live: dict[str, Any]) -> None:
        """Add streamed text; the caller batches fragments between draws."""
        self.record.content += text
        self._spans = spans
        await self._show_split()
        self._refresh_drafted()
        self.record.stats = {**live, "model": (self.record.stats or {}).get("model")}
        self.query_one(".stats", Static).update(shown(self._stats_line()))

    async def finish(self, record: MessageRecord) -> None:
        """Replace live figures with the stored ones and show the final status."""
        self.streaming = False
        self.record = record
        self._spans = list((record.stats or {}).get("drafted_spans", []))
        await self._show_split()
        self._refresh_drafted()
        self.query_one(".role", Label).update(shown(self._role_line()))
        self.query_one(".stats", Static).update(shown(self._stats_line()))

    def code_blocks(self) -> list[str]:
        return [fence.code for fence in self.query(MarkdownFence)]

    def next_code_block(self) -> tuple[int, str] | None:
        """The block F5 copies: the last one first, then each earlier one in turn."""
        blocks = self.code_blocks()
        if not blocks:
            return None
        index = len(blocks) - 1 if not self._code_index else self._code_index - 1
        self._code_index = index
        return index, blocks[index]

    @on(events.Click)
    def _copy_clicked_code(self, event: events.Click) -> None:
        """Clicking a code block copies it (selection with the mouse works as well)."""
        widget = event.widget
        while widget is not None and widget is not self:
            if isinstance(widget, MarkdownFence):
                self.post_message(self.CodeCopied(widget.code))
                return
            widget = widget.parent  # type: ignore[assignment]


class ChatList(OptionList):
    """The conversation list; option ids are chat ids."""

    def set_chats(self, chats: list[ChatRecord], current: int | None) -> None:
        self.clear_options()
        self.add_options([Option(shown(c.title), id=str(c.id)) for c in chats])
        if current is not None:
            try:
                self.highlighted = self.get_option_index(str(current))
            except Exception:
                self.highlighted = None
