"""Helpers for the chat app's Pilot and tmux tests: the app under test, waits on
conditions (never fixed sleeps), an engine slowed to act mid-reply, the autocomplete pane."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

from textual.app import App

from tandem.app.tui.app import AppConfig, TandemApp
from tandem.app.tui.autocomplete_screen import AutocompleteScreen
from tandem.app.tui.chat_screen import ChatScreen
from tandem.app.tui.session import ChatSettings
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.generate import TokenEvent

SIZE = (100, 32)
GREEDY = SamplingParams(temperature=0.0)
PREFIX = "Once upon a time"


class SlowEngine:
    """Wraps a real ChatEngine, sleeping after each token so a test can act mid-reply
    (per token, not per event: a speculative round commits many tokens in one event,
    and the adaptive policy, starting from costs learnt by earlier runs, drafts more)."""

    def __init__(self, engine, delay: float = 0.01) -> None:
        self.engine, self.delay = engine, delay

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def stream(self, *args, **kwargs) -> Iterator:
        for event in self.engine.stream(*args, **kwargs):
            if isinstance(event, TokenEvent):
                time.sleep(self.delay * max(1, len(event.tokens)))
            yield event


def make_app(model: Path | None, tmp_path: Path, max_tokens: int = 16, **config) -> TandemApp:
    return TandemApp(AppConfig(model=model, settings=ChatSettings(GREEDY, max_tokens),
                               export_dir=tmp_path, mask_timings=True, threads=1, **config))


async def ready(app: TandemApp, pilot) -> ChatScreen:
    """Wait until the chat screen has its engine. Not ``workers.wait_for_complete()``: the
    first load's worker starts only after the first paint, so it may not exist yet."""
    await until(pilot, lambda: isinstance(app.screen, ChatScreen) and app.screen.engine is not None)
    await pilot.pause()
    screen = app.screen
    assert isinstance(screen, ChatScreen)
    return screen


async def until(pilot, condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the app"
        await pilot.pause(0.02)


async def await_reply(pilot, screen: ChatScreen, *keys: str) -> None:
    """Press keys that start a reply and wait until it is finished and drawn."""
    done = screen.replies_done
    await pilot.press(*keys)
    await until(pilot, lambda: screen.replies_done > done)
    # The final stats are drawn by the throttled redraw: wait until no view is still live.
    await until(pilot, lambda: not any("streaming" in str(s.render()) for s in screen.query(".stats")))
    await pilot.pause()


async def send(pilot, screen: ChatScreen, text: str) -> None:
    screen.input.load_text(text)
    await await_reply(pilot, screen, "enter")


class PaneApp(App):
    def __init__(self, screen: AutocompleteScreen) -> None:
        super().__init__()
        self.pane = screen
        self.result: str | None = None

    def on_mount(self) -> None:
        def done(text: str | None) -> None:
            self.result = text

        self.push_screen(self.pane, done)


async def wait_for_drafts(pilot, pane: AutocompleteScreen, n_requests: int = 1) -> None:
    for _ in range(400):
        await pilot.pause(0.02)
        if pane.drafts and pane.seq >= n_requests and pane.cancel is None:
            return
    raise AssertionError("no drafts arrived")


def wait_for(tmux: Callable[..., str], text: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        pane = tmux("capture-pane", "-p", "-t", "chat")
        if text in pane:
            return pane
        if time.monotonic() > deadline:
            raise AssertionError(f"{text!r} never appeared; the pane shows:\n{pane}")
        time.sleep(0.2)
