"""Pilot tests of the chat app as a daily driver: Markdown line breaks, 80x24 layout,
search, per-chat models, thinking blocks, copy and continue, stats edge cases."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from textual.widgets import Button, Collapsible, Input, Label, Markdown, OptionList, Static
from textual.widgets._footer import FooterKey
from textual.widgets.markdown import MarkdownFence
from tui_pilot import SIZE, SlowEngine, await_reply, make_app, ready, send, until

from tandem.app.history.database import COMPLETE, INTERRUPTED, History
from tandem.app.tui.chat_screen import ChatScreen
from tandem.app.tui.modals import ModelPicker, SettingsScreen
from tandem.app.tui.search_dialog import SearchScreen
from tandem.app.tui.widgets import MessageView, format_stats

pytestmark = pytest.mark.anyio
NARROW = (80, 24)


@pytest.fixture()
def anyio_backend() -> str:
    return "asyncio"


def seeded_history(path: Path, replies: list[str], *, title: str = "Stored", engine: dict | None = None) -> int:
    """A chat whose assistant replies are given (no model involved); returns its id."""
    with History(path) as h:
        chat = h.create_chat(title)
        for i, reply in enumerate(replies):
            h.add_message(chat.id, "user", f"question {i}")
            h.add_message(chat.id, "assistant", reply, stats={"generated_tokens": 3, "model": "m"})
        if engine:
            h.update_chat(chat.id, engine=engine)
        return chat.id


def assistant_views(screen: ChatScreen) -> list[MessageView]:
    return [v for v in screen.query(MessageView) if v.record.role == "assistant"]


def inside(widget, width: int, height: int) -> bool:
    r = widget.region
    return r.width > 0 and r.height > 0 and r.x >= 0 and r.y >= 0 and r.right <= width and r.bottom <= height


# -- Markdown -----------------------------------------------------------------------------
async def test_single_newlines_break_lines_and_lists_are_single_spaced(stories260k: Path, tmp_path: Path) -> None:
    from textual.widgets._markdown import MarkdownBulletList, MarkdownParagraph

    history = tmp_path / "h.sqlite3"
    seeded_history(history, ["Code is a mirror,\nReflecting light,\nOrder in chaos.\n\n- one\n- two\n- three"])
    app = make_app(stories260k, tmp_path, history_path=history)
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(app, pilot)
        (view,) = assistant_views(screen)
        poem = view.query(MarkdownParagraph).first()
        assert poem.region.height == 3  # one line per line of the haiku, not one joined line
        bullets = view.query_one(MarkdownBulletList)
        assert bullets.region.height == 3  # three items, no blank line between them


# -- 80x24 --------------------------------------------------------------------------------
async def test_footer_keys_and_assistant_label_fit_80_columns(stories260k: Path, tmp_path: Path) -> None:
    history = tmp_path / "h.sqlite3"
    seeded_history(history, ["Short answer."])
    with History(history) as h:  # a long model + drafter label, as with real model names
        (chat,) = h.list_chats()
        msg = h.messages(chat.id)[-1]
        h.finish_reply(msg.id, COMPLETE, {"generated_tokens": 3, "model": "qwen2.5-coder-1.5b-instruct-q4_k_m",
                                          "drafter": "qwen2.5-coder-0.5b-instruct-q8_0"})
    app = make_app(stories260k, tmp_path, history_path=history)
    async with app.run_test(size=NARROW) as pilot:
        screen = await ready(app, pilot)
        keys = list(screen.query(FooterKey))
        shown = {k.key for k in keys}
        assert {"escape", "ctrl+n", "ctrl+r", "ctrl+e", "ctrl+o", "ctrl+t", "ctrl+f", "f5", "f1", "ctrl+q"} <= shown
        for key in keys:
            assert inside(key, *NARROW), f"{key.key} is cut off at {key.region}"
        (view,) = assistant_views(screen)
        label = view.query_one(".role", Label)
        text = str(label.render())
        assert "qwen2.5-coder-0.5b-instruct-q8_0" in text
        assert inside(label, *NARROW)
        assert label.region.width * label.region.height >= len(text)  # wrapped, every character on screen


@pytest.mark.parametrize("key,dialog,buttons", [("ctrl+o", SettingsScreen, ["save", "cancel"]),
                                                ("ctrl+t", ModelPicker, ["apply", "cancel"])])
async def test_dialog_buttons_visible_at_80x24(stories260k: Path, tmp_path: Path, key: str, dialog: type,
                                               buttons: list[str]) -> None:
    app = make_app(stories260k, tmp_path)
    async with app.run_test(size=NARROW) as pilot:
        await ready(app, pilot)
        await pilot.press(key)
        await pilot.pause()
        assert isinstance(app.screen, dialog)
        frame = app.screen.query_one("#dialog")
        for name in buttons:
            button = app.screen.query_one(f"#{name}", Button)
            assert inside(button, *NARROW), f"{name} at {button.region}"
            assert frame.region.contains_region(button.region)


async def test_settings_form_scrolls_and_saves_at_80x24(stories260k: Path, tmp_path: Path) -> None:
    app = make_app(stories260k, tmp_path)
    async with app.run_test(size=NARROW) as pilot:
        screen = await ready(app, pilot)
        await pilot.press("ctrl+o")
        await pilot.pause()
        field = app.screen.query_one("#f-max_tokens", Input)
        field.focus()  # the last field, below the fold: focusing it scrolls it into view
        await pilot.pause()
        assert inside(field, *NARROW)
        field.value = "33"
        await pilot.click("#save")
        await until(pilot, lambda: app.screen is screen)
        assert screen.chat is not None and screen.chat.params["max_tokens"] == 33


# -- model picker -------------------------------------------------------------------------
async def test_model_picker_lists_the_model_given_by_path_when_the_store_is_empty(
        stories260k: Path, tmp_path: Path) -> None:
    app = make_app(stories260k, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        await pilot.press("ctrl+t")
        targets = app.screen.query_one("#target-list", OptionList)
        assert [targets.get_option_at_index(i).prompt for i in range(targets.option_count)] == ["stories260K"]
        assert targets.highlighted == 0


# -- stats --------------------------------------------------------------------------------
async def test_a_one_token_reply_shows_no_speed(stories260k: Path, tmp_path: Path) -> None:
    app = make_app(stories260k, tmp_path, max_tokens=1)
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(app, pilot)
        await send(pilot, screen, "Once upon a time")
        reply = app.history.messages(screen.chat.id)[-1]
        assert reply.stats["generated_tokens"] == 1
        line = str(assistant_views(screen)[-1].query_one(".stats", Static).render())
        assert "1 tokens" in line and "tok/s" not in line


def test_format_stats_leaves_out_undefined_speed() -> None:
    assert "tok/s" not in format_stats({"generated_tokens": 1, "tokens_per_s": 0.0, "ttft_s": 0.1})
    assert "tok/s" not in format_stats({"generated_tokens": 5, "tokens_per_s": 0.0})
    assert "12.5 tok/s" in format_stats({"generated_tokens": 5, "tokens_per_s": 12.5})


# -- search -------------------------------------------------------------------------------
async def test_search_finds_a_message_in_another_chat_and_jumps_to_it(stories260k: Path, tmp_path: Path) -> None:
    history = tmp_path / "h.sqlite3"
    target_chat = seeded_history(history, ["Nothing to see.", "The zebra crossing is ahead.",
                                           *(f"Filler reply {i}.\n\nWith a second paragraph." for i in range(12))],
                                 title="Animals")
    seeded_history(history, ["Unrelated reply."], title="Newer chat")  # opens first (most recent)
    app = make_app(stories260k, tmp_path, history_path=history)
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(app, pilot)
        assert screen.chat.title == "Newer chat"
        await pilot.press("ctrl+f")
        assert isinstance(app.screen, SearchScreen)
        await pilot.press(*"zebr")
        results = app.screen.query_one("#search-results", OptionList)
        await until(pilot, lambda: results.option_count == 1)
        assert "zebra" in str(results.get_option_at_index(0).prompt) and "Animals" in str(
            results.get_option_at_index(0).prompt)
        await pilot.press("enter")
        await until(pilot, lambda: app.screen is screen and screen.chat.id == target_chat)
        focused = screen.focused
        assert isinstance(focused, MessageView) and "zebra" in focused.record.content
        box = screen.query_one("#messages")
        await until(pilot, lambda: focused.region.height > 0 and box.region.contains_region(focused.region))
        await pilot.press("f6")  # acts on the focused reply
        assert app.clipboard == "The zebra crossing is ahead."
        await pilot.press(*"ok")  # typing goes to the input box, not into the void
        assert screen.input.text == "ok" and screen.focused is screen.input


# -- per-chat models ----------------------------------------------------------------------
async def test_each_chat_reopens_with_its_own_model(stories260k: Path, tmp_path: Path) -> None:
    other = tmp_path / "other-model.gguf"
    shutil.copy(stories260k, other)
    history = tmp_path / "h.sqlite3"
    first = seeded_history(history, ["from the copy"], title="Uses the copy",
                           engine={"target": str(other), "drafter": None, "draft_mode": None})
    seeded_history(history, ["from the original"], title="Uses the original",
                   engine={"target": str(stories260k), "drafter": None, "draft_mode": None})
    app = make_app(None, tmp_path, history_path=history)  # no -m: the latest chat's model
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(app, pilot)
        assert screen.choice.target == stories260k and screen.chat.title == "Uses the original"
        chat_list = screen.query_one("#chat-list", OptionList)
        chat_list.highlighted = chat_list.get_option_index(str(first))
        chat_list.action_select()
        await until(pilot, lambda: screen.chat.id == first and screen.engine is not None
                    and screen.choice.target == other, timeout=90)  # a model load on a busy machine
        await send(pilot, screen, "Once upon a time")
        assert app.history.get_chat(first).engine["target"] == str(other)


async def test_a_chat_whose_model_has_gone_keeps_the_current_one(stories260k: Path, tmp_path: Path) -> None:
    history = tmp_path / "h.sqlite3"
    gone = seeded_history(history, ["old"], title="Old model",
                          engine={"target": str(tmp_path / "deleted.gguf"), "drafter": None, "draft_mode": None})
    seeded_history(history, ["new"], title="Current")
    app = make_app(stories260k, tmp_path, history_path=history)
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(app, pilot)
        chat_list = screen.query_one("#chat-list", OptionList)
        chat_list.highlighted = chat_list.get_option_index(str(gone))
        chat_list.action_select()
        await until(pilot, lambda: screen.chat.id == gone)
        await pilot.pause()
        assert screen.choice.target == stories260k and screen.engine is not None
        assert any("no longer at" in n.message for n in app._notifications)


# -- thinking -----------------------------------------------------------------------------
async def test_think_blocks_are_collapsed_and_toggle(stories260k: Path, tmp_path: Path) -> None:
    history = tmp_path / "h.sqlite3"
    seeded_history(history, ["<think>\nThe user wants a number. Seven is prime.\n</think>\n\nThe answer is **7**."])
    app = make_app(stories260k, tmp_path, history_path=history)
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(app, pilot)
        (view,) = assistant_views(screen)
        block = view.query_one(".thinking", Collapsible)
        assert block.display and block.collapsed
        assert "Thought (8 words)" in block.title
        assert view.query_one(".body", Markdown).source == "The answer is **7**."
        await pilot.press("f3")
        assert not block.collapsed
        assert "Seven is prime." in str(view.query_one(".thinking-text", Static).render())
        await pilot.press("f3")
        assert block.collapsed


# -- copy ---------------------------------------------------------------------------------
async def test_copy_the_reply_and_each_code_block(stories260k: Path, tmp_path: Path) -> None:
    reply = "Two snippets:\n\n```python\nfirst()\n```\n\nand\n\n```sh\nsecond\n```\n"
    history = tmp_path / "h.sqlite3"
    seeded_history(history, [reply])
    app = make_app(stories260k, tmp_path, history_path=history)
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(app, pilot)
        await until(pilot, lambda: len(list(screen.query(MarkdownFence))) == 2)
        await pilot.press("f6")
        assert app.clipboard == reply
        await pilot.press("f5")
        assert app.clipboard.strip() == "second"
        await pilot.press("f5")
        assert app.clipboard.strip() == "first()"
        await pilot.press("f5")
        assert app.clipboard.strip() == "second"  # round again


# -- continue -----------------------------------------------------------------------------
async def test_continue_an_interrupted_reply(stories260k: Path, tmp_path: Path) -> None:
    app = make_app(stories260k, tmp_path, max_tokens=40)
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(app, pilot)
        real = screen.engine
        screen.engine = SlowEngine(real, delay=0.05)
        screen.input.load_text("Once upon a time")
        await pilot.press("enter")
        await until(pilot, lambda: screen.replies.view is not None and len(screen.replies.view.record.content) > 10)
        await await_reply(pilot, screen, "escape")
        partial = app.history.messages(screen.chat.id)[-1]
        assert partial.status == INTERRUPTED and partial.content
        screen.engine = real
        done_before = screen.replies_done
        await pilot.press("f7")
        await until(pilot, lambda: screen.replies_done > done_before, timeout=90)  # slow on a busy machine
        messages = app.history.messages(screen.chat.id)
        assert len(messages) == 2  # continued in place, no new message
        done = messages[-1]
        assert done.id == partial.id and done.status == COMPLETE
        assert done.content.startswith(partial.content) and len(done.content) > len(partial.content)
        assert done.stats["continued"] == 1
        assert done.stats["generated_tokens"] > partial.stats["generated_tokens"]
        (view,) = assistant_views(screen)
        assert view.query_one(".body", Markdown).source == done.content
        assert "interrupted" not in str(view.query_one(".role", Label).render())


async def test_continue_refuses_a_complete_reply(stories260k: Path, tmp_path: Path) -> None:
    app = make_app(stories260k, tmp_path, max_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(app, pilot)
        await send(pilot, screen, "Once upon a time")
        done = screen.replies_done
        await pilot.press("f7")
        await pilot.pause()
        assert screen.replies_done == done and screen.replies.worker is None
        assert any("Only an interrupted" in n.message for n in app._notifications)


# -- progress -----------------------------------------------------------------------------
def test_loading_reports_its_stages(stories260k: Path) -> None:
    from tandem.app.tui.model_choice import LoadProgress, ModelChoice, close_engine, load_engine
    from tandem.runtime.engine.spec import EngineSpec

    stages: list[str] = []
    loaded: list[float] = []
    close_engine(load_engine(ModelChoice(EngineSpec(stories260k, draft_mode="ngram", measure_cost=False)),
                             progress=stages.append, on_load=loaded.append))
    assert stages[:2] == ["planning memory", "loading the model"]
    assert any("speculative" in s for s in stages)
    assert loaded and loaded[-1] == 1.0  # llama.cpp's own load progress reaches the status line
    progress = LoadProgress("qwen", "loading the model", started=100.0)
    assert progress.line(now=103.4) == "Loading qwen: loading the model… 3 s"
    progress.loaded = 0.42
    assert progress.line(now=103.4) == "Loading qwen: loading the model 42%… 3 s"
    progress.stage = "placing the drafter"  # the share is the weights': not shown for later stages
    assert progress.line(now=104.0) == "Loading qwen: placing the drafter… 4 s"


def test_format_stats_says_when_a_named_drafter_was_not_loaded() -> None:
    """A drafter that stores the target's vocabulary loads when first asked for a draft:
    until then it holds no memory, and the line says so instead of leaving it out."""
    memory = {"target": 1 << 20, "drafter": 0, "kv": 1 << 20}
    assert "+ drafter not loaded +" in format_stats({"generated_tokens": 5, "drafter": "qwen", "memory": memory})
    loaded = format_stats({"generated_tokens": 5, "drafter": "qwen", "memory": {**memory, "drafter": 1 << 20}})
    assert "+ drafter 1.0 MB +" in loaded and "not loaded" not in loaded
    assert "drafter" not in format_stats({"generated_tokens": 5, "memory": memory})
    model_free = {"target": 1 << 20, "kv": 1 << 20}  # no drafter model: no weights to speak of
    assert "drafter" not in format_stats({"generated_tokens": 5, "drafter": "model-free", "memory": model_free})
