"""The search dialog (Ctrl+F): full-text search over every chat, Enter jumps to the hit.

Queries go to SQLite FTS5 (:meth:`History.search`) on every keystroke: the index
answers in milliseconds even for thousands of messages, so there is no worker and
no debounce.
"""

from __future__ import annotations

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.widgets import Input, Label, OptionList
from textual.widgets.option_list import Option

from tandem.app.history.database import History
from tandem.app.history.full_text import HIT_END, HIT_START, SearchHit
from tandem.app.tui.modals import Dialog
from tandem.app.tui.shown import plain


def hit_text(hit: SearchHit) -> Text:
    """One result: the chat's title and who wrote the message, then the matched text
    with the matching words highlighted (the snippet's own line breaks flattened)."""
    who = "you" if hit.role == "user" else hit.role
    text = Text.assemble((plain(hit.chat_title), "bold"), (f" · {plain(who)}", "dim"), "\n")
    snippet = " ".join(hit.snippet.split())
    while snippet:
        start = snippet.find(HIT_START)
        if start < 0:
            text.append(plain(snippet))
            break
        end = snippet.find(HIT_END, start)
        end = len(snippet) if end < 0 else end
        text.append(plain(snippet[:start]))
        text.append(plain(snippet[start + 1:end]), "bold reverse")
        snippet = snippet[end + 1:]
    return text


def hit_id(hit: SearchHit) -> str:
    return f"{hit.chat_id}:{hit.message_id}"


def parse_hit_id(option_id: str) -> tuple[int, int]:
    chat_id, message_id = option_id.split(":")
    return int(chat_id), int(message_id)


class SearchScreen(Dialog):
    """Returns ``(chat_id, message_id)`` of the chosen hit, or ``None``."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("down", "results", "Results", show=False)]

    def __init__(self, history: History, query: str = "") -> None:
        super().__init__()
        self.history = history
        self.query_text = query
        self.hits: list[SearchHit] = []

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="search"):
            yield Label("Search all chats", classes="dialog-title")
            yield Input(self.query_text, placeholder="Words to find (Enter opens the first hit)", id="search-input")
            yield OptionList(id="search-results")
            yield Label("", id="search-count")

    def on_mount(self) -> None:
        self.query_one("#search-input", Input).focus()
        self._search(self.query_text)

    @on(Input.Changed, "#search-input")
    def _changed(self, event: Input.Changed) -> None:
        self._search(event.value)

    def _search(self, query: str) -> None:
        self.hits = self.history.search(query) if query.strip() else []
        results = self.query_one("#search-results", OptionList)
        results.clear_options()
        results.add_options([Option(hit_text(h), id=hit_id(h)) for h in self.hits])
        if self.hits:
            results.highlighted = 0
        n = len(self.hits)
        count = "" if not query.strip() else f"{n} message{'s' if n != 1 else ''}" if n else "No messages match."
        self.query_one("#search-count", Label).update(count)

    @on(Input.Submitted, "#search-input")
    def _open_first(self) -> None:
        results = self.query_one("#search-results", OptionList)
        index = results.highlighted if results.highlighted is not None else 0
        if self.hits:
            self.dismiss((self.hits[index].chat_id, self.hits[index].message_id))

    def action_results(self) -> None:
        if self.hits:
            self.query_one("#search-results", OptionList).focus()

    @on(OptionList.OptionSelected, "#search-results")
    def _chosen(self, event: OptionList.OptionSelected) -> None:
        if event.option.id is not None:
            self.dismiss(parse_hit_id(event.option.id))
