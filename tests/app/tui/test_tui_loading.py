"""`tandem chat` while its model loads: the input is there at once, and a message sent
then is kept, shown, and answered as soon as the model is ready (never dropped)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from textual.widgets import Label
from tui_pilot import SIZE, make_app, until

import tandem.app.tui.model_loading as model_loading
from tandem.app.history.database import COMPLETE
from tandem.app.tui.chat_screen import ChatScreen
from tandem.app.tui.widgets import MessageView

pytestmark = pytest.mark.anyio


@pytest.fixture()
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture()
def held_load(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Model loads wait for the returned event (set it to let them finish)."""
    gate = threading.Event()
    real = model_loading.load_engine

    def held(*args, **kwargs):
        assert gate.wait(60), "the test never let the load finish"
        return real(*args, **kwargs)

    monkeypatch.setattr(model_loading, "load_engine", held)
    return gate


def status(screen: ChatScreen) -> str:
    return str(screen.query_one("#status", Label).render())


async def loading_screen(app, pilot) -> ChatScreen:
    await until(pilot, lambda: isinstance(app.screen, ChatScreen) and app.screen.loader.progress is not None)
    return app.screen


async def test_input_is_ready_before_the_model(stories260k: Path, tmp_path: Path, held_load: threading.Event) -> None:
    app = make_app(stories260k, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await loading_screen(app, pilot)
        await pilot.pause()
        assert screen.engine is None  # the load is held: nothing is loaded yet
        box = screen.input
        assert box.display and box.region.height > 0 and box.has_focus
        assert status(screen).startswith("Loading stories260K")
        await pilot.press("H", "i")
        assert box.text == "Hi"  # typing works while it loads
        held_load.set()
        await until(pilot, lambda: screen.engine is not None)
        assert status(screen).startswith("Model stories260K")


async def test_message_sent_while_loading_is_answered_when_ready(stories260k: Path, tmp_path: Path,
                                                                 held_load: threading.Event) -> None:
    app = make_app(stories260k, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await loading_screen(app, pilot)
        screen.input.load_text("Once upon a time")
        await pilot.press("enter")
        await until(pilot, lambda: screen.loader.queued is not None)
        assert screen.input.text == ""  # taken: one Enter sends it
        assert [v.record.content for v in screen.query(MessageView)] == ["Once upon a time"]
        assert [m.role for m in app.history.messages(screen.chat.id)] == ["user"]  # stored, not dropped
        assert "answered when the model is ready" in status(screen)
        assert screen.replies_done == 0 and screen.engine is None
        held_load.set()
        await until(pilot, lambda: screen.replies_done == 1, timeout=60)
        user, reply = app.history.messages(screen.chat.id)
        assert (user.content, reply.role, reply.status) == ("Once upon a time", "assistant", COMPLETE)
        assert reply.content.strip() and reply.stats["generated_tokens"] == 16
        assert screen.loader.queued is None and "answered when" not in status(screen)


async def test_message_queued_through_a_failed_load_is_answered_by_the_next_model(
        stories260k: Path, tmp_path: Path, held_load: threading.Event) -> None:
    """A load that fails keeps the queued message; the model chosen next answers it."""
    missing = tmp_path / "gone.gguf"
    app = make_app(missing, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await loading_screen(app, pilot)
        screen.input.load_text("Once upon a time")
        await pilot.press("enter")
        await until(pilot, lambda: screen.loader.queued is not None)
        held_load.set()
        await until(pilot, lambda: screen.loader.progress is None)
        assert screen.engine is None and "Could not load gone" in status(screen)
        assert [m.role for m in app.history.messages(screen.chat.id)] == ["user"]
        screen.loader.load(screen.choice.with_models(stories260k, None))
        await until(pilot, lambda: screen.replies_done == 1, timeout=60)
        assert [m.role for m in app.history.messages(screen.chat.id)] == ["user", "assistant"]
