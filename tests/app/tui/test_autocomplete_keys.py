"""Draft cycling keys that work in every terminal (Ctrl+], F7/F8), and no blank draft rows."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
from textual.widgets import Label
from tui_pilot import PREFIX, PaneApp, wait_for_drafts

from tandem.app.tui.autocomplete_screen import AutocompleteScreen, shown_drafts
from tandem.runtime.autocomplete.drafts import AutocompleteConfig, Autocompleter, Suggestion

pytestmark = pytest.mark.anyio


@pytest.fixture()
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture()
def completer(stories_backend) -> Autocompleter:
    return Autocompleter(stories_backend, None, AutocompleteConfig(k=3, max_tokens=8, single_line=True))


class WithBlanks:
    """The real autocompleter, plus an empty and a whitespace-only draft in every answer."""

    def __init__(self, inner: Autocompleter) -> None:
        self.inner = inner

    def suggest(self, prefix, suffix, k, budget_ms, *, cancel=None):
        result = self.inner.suggest(prefix, suffix, k, budget_ms, cancel=cancel)
        blanks = [Suggestion("", [], 0.0), Suggestion("  ", [], 0.0)]
        return replace(result, suggestions=[blanks[0], *result.suggestions, blanks[1]])


async def test_ctrl_bracket_and_function_keys_cycle(completer) -> None:
    pane = AutocompleteScreen(completer, text=PREFIX, budget_ms=0)
    async with PaneApp(pane).run_test() as pilot:
        await wait_for_drafts(pilot, pane)
        drafts = list(pane.drafts)
        assert len(drafts) == 3
        seen = [pane.editor.suggestion]
        for key in ("ctrl+right_square_bracket", "f8", "ctrl+right_square_bracket"):
            await pilot.press(key)
            seen.append(pane.editor.suggestion)
        assert seen == [drafts[0], drafts[1], drafts[2], drafts[0]]
        await pilot.press("f7")
        assert pane.editor.suggestion == drafts[2]


async def test_blank_drafts_are_not_listed(completer) -> None:
    pane = AutocompleteScreen(WithBlanks(completer), text=PREFIX, budget_ms=0)  # type: ignore[arg-type]
    async with PaneApp(pane).run_test() as pilot:
        await wait_for_drafts(pilot, pane)
        assert all(d.strip() for d in pane.drafts) and pane.editor.suggestion.strip()
        rows = str(pane.query_one("#ac-drafts", Label).render()).splitlines()
        assert len(rows) == len(pane.drafts)
        assert all(row.split(". ", 1)[1].strip() for row in rows)


def test_shown_drafts_drops_blanks_and_repeats() -> None:
    assert shown_drafts(["", " a", "\t", " a", "b"]) == [" a", "b"]


class Held:
    """The real autocompleter behind a gate the test opens."""

    def __init__(self, inner: Autocompleter) -> None:
        self.inner = inner
        self.gate = threading.Event()

    def suggest(self, prefix, suffix, k, budget_ms, *, cancel=None):
        self.gate.wait(30)
        return self.inner.suggest(prefix, suffix, k, budget_ms, cancel=cancel)


async def test_a_slow_first_request_shows_warm_up_progress(completer) -> None:
    held = Held(completer)
    pane = AutocompleteScreen(held, text=PREFIX, budget_ms=0)  # type: ignore[arg-type]
    async with PaneApp(pane).run_test() as pilot:
        status = pane.query_one("#ac-status", Label)
        try:
            for _ in range(200):  # the notice comes once the request has run a second
                if "Warming up autocomplete (first use)…" in str(status.render()):
                    break
                await pilot.pause(0.05)
            assert "Warming up autocomplete (first use)…" in str(status.render())
            assert str(status.render()).endswith(" s")
        finally:
            held.gate.set()
        await wait_for_drafts(pilot, pane)
        assert "drafts in" in str(status.render())
