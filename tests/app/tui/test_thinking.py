"""<think> blocks: split from the answer on partial (streaming) text, and drawn collapsed
while a reasoning model streams."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from textual.widgets import Collapsible, Markdown, Static
from tui_pilot import SIZE, make_app, ready, until

from tandem.app.tui.thinking import Split, split_thinking
from tandem.app.tui.widgets import MessageView
from tandem.runtime.generate import DoneEvent, GenerationStats, TokenEvent

pytestmark = pytest.mark.anyio


@pytest.fixture()
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize("text,expected", [
    ("plain answer", Split(None, "plain answer", True)),
    ("<th", Split("", "", False)),  # the tag's first characters never show as the answer
    ("<think>\nstep one", Split("step one", "", False)),
    ("<think>\nstep one\n</think>\n\nThe answer.", Split("step one", "The answer.", True)),
    ("reasoning opened by the template</think>Done.", Split("reasoning opened by the template", "Done.", True)),
    ("  <think>a</think>b", Split("a", "b", True)),
    ("Use the <think> tag like this.", Split(None, "Use the <think> tag like this.", True)),
])
def test_split_thinking(text: str, expected: Split) -> None:
    assert split_thinking(text) == expected


class ThinkingEngine:
    """Streams a reasoning model's reply in small fragments, holding each until released."""

    FRAGMENTS = ["<th", "ink>\nFirst I ", "add the numbers.", "\n</thi", "nk>\n\nIt is **4**."]

    def __init__(self, target) -> None:
        self.target = target
        """The app's real model (its token bytes colour drafted text; nothing is drafted here)."""
        self.sent = 0
        self.allowed = 0

    def stream(self, messages, params, max_tokens, stop=(), cancel=None, reply_prefix="", keep_start=False):
        for i, text in enumerate(self.FRAGMENTS):
            while self.allowed <= i:
                time.sleep(0.01)
            self.sent = i + 1
            yield TokenEvent(text, [i])
        yield DoneEvent("".join(self.FRAGMENTS), list(range(len(self.FRAGMENTS))), GenerationStats(
            3, len(self.FRAGMENTS), 0.1, 0.2, 10.0, 5, 1.0, 0, 0, None, "stop", 0))

    def stats_memory(self) -> dict[str, int]:
        return {"target": 1, "drafter": 0, "kv": 1, "total": 2}


async def test_a_streaming_think_block_stays_collapsed_above_the_answer(stories260k: Path, tmp_path: Path) -> None:
    app = make_app(stories260k, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(app, pilot)
        fake = ThinkingEngine(screen.engine.target)
        screen.engine = fake
        screen.input.load_text("What is 2+2?")
        await pilot.press("enter")
        await until(pilot, lambda: screen.replies.view is not None)
        view: MessageView = screen.replies.view
        body = view.query_one(".body", Markdown)
        block = view.query_one(".thinking", Collapsible)
        for step in range(1, 4):  # inside the think block: nothing in the answer yet
            fake.allowed = step
            drawn = "".join(fake.FRAGMENTS[:step])
            await until(pilot, lambda d=drawn: view.record.content == d)  # the view has drawn it
            assert body.source == "" and block.collapsed
        await until(pilot, lambda: "Thinking…" in block.title)
        fake.allowed = len(fake.FRAGMENTS)
        await until(pilot, lambda: screen.replies_done == 1)
        await until(pilot, lambda: body.source == "It is **4**.")
        assert block.collapsed and "Thought (5 words)" in block.title
        assert "First I add the numbers." in str(view.query_one(".thinking-text", Static).render())
