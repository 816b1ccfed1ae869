"""The autocomplete pane: ghost text from k superposed drafts as you type.

Every edit cancels the request in flight (its cancel event stops the decoder at the
next step) and, after a short debounce, asks for new drafts around the cursor (FIM when
the model has FIM tokens). Results carry the request's sequence number, so a late
answer to stale text is dropped instead of shown. Tab accepts the ghost text; Ctrl+] or
F8 (also Alt+], Ctrl+Down) shows the next of the k drafts and F7 (Alt+[, Ctrl+Up) the
previous one; Esc closes the pane and hands the text back to the chat input.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, Header, Label, TextArea

from tandem.app.tui.shown import plain, shown
from tandem.errors import TandemError

if TYPE_CHECKING:
    from tandem.runtime.autocomplete.drafts import Autocompleter, SuggestResult
    from tandem.runtime.chat import ChatEngine

WAIT_NOTICE_S = 1.0
"""A request running longer than this shows a waiting line with the time so far."""
DEBOUNCE_S = 0.12
"""Wait this long after a keystroke before asking: fast typists do not queue requests."""


class DraftsReady(Message):
    def __init__(self, seq: int, result: SuggestResult | None, error: str | None = None) -> None:
        super().__init__()
        self.seq, self.result, self.error = seq, result, error


def shown_drafts(texts: Iterable[str]) -> list[str]:
    """The drafts worth showing: not blank (nothing to accept), each text once."""
    out: list[str] = []
    for text in texts:
        if text.strip() and text not in out:
            out.append(text)
    return out


def make_autocompleter(engine: ChatEngine, k: int = 3, budget_ms: float = 400.0) -> Autocompleter:
    """An autocompleter sharing the chat engine's model and lock (one KV cache, one user);
    built in the pane's worker on the first request."""
    # local: keeps the runtime out of the chat app's first paint
    from tandem.runtime.autocomplete.drafts import AutocompleteConfig, Autocompleter, load_ngram_for

    target = engine.target
    cfg = AutocompleteConfig(k=k, budget_ms=budget_ms, single_line=True)
    return Autocompleter(target, load_ngram_for(target), cfg, lock=engine.lock)


class AutocompleteScreen(Screen[str]):
    """An editor with ghost-text drafts; dismisses with the edited text."""

    BINDINGS = [
        Binding("tab", "accept", "Accept", priority=True),
        # Alt+] reaches an app as ESC ], which tmux and many terminals read as the start of
        # an OSC sequence: Ctrl+] and the function keys work everywhere.
        Binding("ctrl+right_square_bracket,f8,alt+right_square_bracket,ctrl+down", "cycle(1)", "Next",
                priority=True, key_display="^]/f8"),
        Binding("f7,alt+left_square_bracket,ctrl+up", "cycle(-1)", "Previous", priority=True),
        Binding("escape", "close", "Back to chat"),
    ]
    DEFAULT_CSS = """
    AutocompleteScreen #ac-editor { height: 1fr; }
    AutocompleteScreen #ac-drafts { height: auto; max-height: 8; padding: 0 1; color: $text-muted; }
    AutocompleteScreen #ac-status { height: 1; padding: 0 1; color: $text-muted; }
    """

    def __init__(self, autocompleter: Autocompleter | None = None, engine: ChatEngine | None = None, text: str = "",
                 *, k: int = 3, budget_ms: float = 400.0, debounce_s: float = DEBOUNCE_S) -> None:
        super().__init__()
        self.autocompleter = autocompleter
        self.engine = engine
        self.initial = text
        self.k, self.budget_ms, self.debounce_s = k, budget_ms, debounce_s
        self.drafts: list[str] = []
        self.index = 0
        self.seq = 0
        """Sequence number of the newest request; older answers are stale."""
        self.cancel: threading.Event | None = None
        self.cancelled: list[int] = []
        """Sequence numbers of requests cancelled by typing (shown in tests and stats)."""
        self.last: SuggestResult | None = None
        self.asked_at = 0.0
        self._timer: Any = None
        self._suppress_change = False

    @property
    def editor(self) -> TextArea:
        return self.query_one("#ac-editor", TextArea)

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False, icon="≈")
        yield TextArea(plain(self.initial), id="ac-editor", soft_wrap=True, tab_behavior="focus")
        yield Label("", id="ac-drafts")
        yield Label("Type: drafts appear as ghost text.", id="ac-status")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "Autocomplete (superposed drafts)"
        self.set_interval(0.5, self._show_waiting)
        ed = self.editor
        ed.hide_suggestion_on_blur = False
        ed.move_cursor(ed.document.end)
        ed.focus()
        if self.initial:
            self.request()

    # -- requests -------------------------------------------------------------------
    @on(TextArea.Changed, "#ac-editor")
    def _changed(self, event: TextArea.Changed) -> None:
        if self._suppress_change:
            self._suppress_change = False
            return
        self._cancel_inflight()
        self.drafts, self.index = [], 0
        self._show_drafts()
        if self._timer is not None:
            self._timer.stop()
        self._timer = self.set_timer(self.debounce_s, self.request)

    def _cancel_inflight(self) -> None:
        if self.cancel is not None and not self.cancel.is_set():
            self.cancel.set()
            self.cancelled.append(self.seq)

    def request(self) -> None:
        """Ask for drafts for the text around the cursor now (cancelling any older ask)."""
        self._cancel_inflight()
        self.seq += 1
        self.asked_at = time.monotonic()
        self.cancel = threading.Event()
        ed = self.editor
        row, col = ed.cursor_location
        text = ed.text
        lines = text.split("\n")
        offset = sum(len(line) + 1 for line in lines[:row]) + col
        self._suggest(self.seq, text[:offset], text[offset:], self.cancel)

    @work(thread=True, group="autocomplete", exit_on_error=False)
    def _suggest(self, seq: int, prefix: str, suffix: str, cancel: threading.Event) -> None:
        try:
            if self.autocompleter is None:
                if self.engine is None:
                    raise TandemError("The model is still loading.")
                self.autocompleter = make_autocompleter(self.engine, self.k, self.budget_ms)
            result = self.autocompleter.suggest(prefix, suffix, self.k, self.budget_ms, cancel=cancel)
            self.post_message(DraftsReady(seq, result))
        except TandemError as exc:
            self.post_message(DraftsReady(seq, None, str(exc)))

    def _show_waiting(self) -> None:
        """A request that takes over a second says so, with the time so far: the first one
        also sets the autocompleter up (reads the model's embeddings, warms its cache)."""
        waited = time.monotonic() - self.asked_at
        if self.cancel is None or self.cancel.is_set() or waited < WAIT_NOTICE_S:
            return
        what = "Warming up autocomplete (first use)" if self.autocompleter is None or self.last is None \
            else "Waiting for drafts"
        self.query_one("#ac-status", Label).update(shown(f"{what}… {waited:.0f} s"))

    def on_drafts_ready(self, message: DraftsReady) -> None:
        if message.seq != self.seq or (self.cancel is not None and self.cancel.is_set()):
            return  # stale: the text changed since this was asked
        self.cancel = None
        if message.error:
            self.query_one("#ac-status", Label).update(shown(f"Autocomplete unavailable: {message.error}"))
            return
        result = message.result
        assert result is not None
        self.last = result
        self.drafts = shown_drafts(s.text for s in result.suggestions)
        self.index = 0
        self._show_drafts()
        mode = "FIM" if result.fim else "continuation"
        self.query_one("#ac-status", Label).update(
            f"{len(self.drafts)} drafts in {result.elapsed_ms:.0f} ms ({mode}, stopped: {result.stopped}) · "
            "Tab accept · Ctrl+] / F8 next · F7 previous · Esc back")

    def _show_drafts(self) -> None:
        self.editor.suggestion = self.drafts[self.index] if self.drafts else ""
        lines = [f"{'▶' if i == self.index else ' '} {i + 1}. {d}" for i, d in enumerate(self.drafts)]
        self.query_one("#ac-drafts", Label).update(shown("\n".join(lines)))

    # -- actions --------------------------------------------------------------------
    def action_accept(self) -> None:
        ed = self.editor
        if not ed.suggestion:
            return
        ed.insert(ed.suggestion)  # a user edit: the Changed handler asks for the next drafts

    def action_cycle(self, step: int) -> None:
        if len(self.drafts) > 1:
            self.index = (self.index + step) % len(self.drafts)
            self._show_drafts()

    def action_close(self) -> None:
        self._cancel_inflight()
        self.dismiss(self.editor.text)


def open_autocomplete(engine: ChatEngine | None, chat_input: TextArea) -> None:
    """The chat screen's F9: edit ``chat_input``'s text in the pane, with ``engine``'s
    drafts; the edited text comes back to the input."""
    if engine is None:
        chat_input.notify("The model is still loading; try again in a moment.", severity="warning")
        return

    def done(text: str | None) -> None:
        if text is not None:
            chat_input.text = text
            chat_input.move_cursor(chat_input.document.end)
        chat_input.focus()

    chat_input.app.push_screen(AutocompleteScreen(engine=engine, text=chat_input.text), done)
