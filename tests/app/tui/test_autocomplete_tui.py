"""Pilot tests of the autocomplete pane on a real model: ghost text, accept, cycle, cancel."""

from __future__ import annotations

import threading

import pytest
from tui_pilot import PREFIX, PaneApp, wait_for_drafts

from tandem.app.tui.autocomplete_screen import AutocompleteScreen
from tandem.runtime.autocomplete.drafts import AutocompleteConfig, Autocompleter

pytestmark = pytest.mark.anyio


@pytest.fixture()
def anyio_backend() -> str:
    return "asyncio"




@pytest.fixture()
def completer(stories_backend) -> Autocompleter:
    return Autocompleter(stories_backend, None, AutocompleteConfig(k=3, max_tokens=8, single_line=True))




async def test_ghost_text_and_tab_accepts(completer) -> None:
    expected = completer.suggest(PREFIX, "", 3, budget_ms=0).suggestions  # same question, asked directly
    pane = AutocompleteScreen(completer, text=PREFIX, budget_ms=0)
    app = PaneApp(pane)
    async with app.run_test() as pilot:
        await wait_for_drafts(pilot, pane)
        assert pane.drafts == [s.text for s in expected]
        assert pane.editor.suggestion == pane.drafts[0]
        best = pane.drafts[0]
        await pilot.press("tab")
        await pilot.pause()
        assert pane.editor.text == PREFIX + best
        await pilot.press("escape")
        await pilot.pause()
    assert app.result == PREFIX + best


async def test_cycle_through_drafts(completer) -> None:
    pane = AutocompleteScreen(completer, text=PREFIX, budget_ms=0)
    async with PaneApp(pane).run_test() as pilot:
        await wait_for_drafts(pilot, pane)
        drafts = list(pane.drafts)
        assert len(drafts) == 3 and len(set(drafts)) == 3
        seen = [pane.editor.suggestion]
        for _ in range(3):
            await pilot.press("ctrl+down")
            seen.append(pane.editor.suggestion)
        assert seen == [drafts[0], drafts[1], drafts[2], drafts[0]]  # wraps around
        await pilot.press("ctrl+up")
        assert pane.editor.suggestion == drafts[2]
        await pilot.press("tab")
        await pilot.pause()
        assert pane.editor.text == PREFIX + drafts[2]


class GatedCompleter:
    """The real autocompleter, but the first request waits until the test lets it go."""

    def __init__(self, inner: Autocompleter) -> None:
        self.inner = inner
        self.gate = threading.Event()
        self.calls: list[tuple[str, threading.Event]] = []

    def suggest(self, prefix, suffix, k, budget_ms, *, cancel=None):
        self.calls.append((prefix, cancel))
        if len(self.calls) == 1:
            self.gate.wait(10)
        return self.inner.suggest(prefix, suffix, k, budget_ms, cancel=cancel)


async def test_typing_cancels_stale_request(completer) -> None:
    gated = GatedCompleter(completer)
    pane = AutocompleteScreen(gated, text=PREFIX, budget_ms=0, debounce_s=0.01)  # type: ignore[arg-type]
    async with PaneApp(pane).run_test() as pilot:
        for _ in range(100):
            await pilot.pause(0.02)
            if gated.calls:
                break
        assert len(gated.calls) == 1  # the first request is stuck behind the gate
        await pilot.press("comma")  # the user types on
        first_cancel = gated.calls[0][1]
        assert first_cancel.is_set()  # typing cancelled the request in flight
        gated.gate.set()
        await wait_for_drafts(pilot, pane, n_requests=2)
        assert gated.calls[-1][0] == PREFIX + ","
        fresh = completer.suggest(PREFIX + ",", "", 3, budget_ms=0).suggestions
        assert pane.drafts == [s.text for s in fresh]  # the stale answer never showed
        assert pane.cancelled == [1]
