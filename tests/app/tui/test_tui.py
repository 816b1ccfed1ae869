"""Pilot tests of `tandem chat`: every interaction, driven by keys against the real fixture model."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from textual.widgets import Input, Label, Markdown, OptionList, Static, TextArea
from tui_pilot import GREEDY, SIZE, SlowEngine, await_reply, make_app, ready, send, until

from tandem.app.history.database import COMPLETE, INTERRUPTED, History
from tandem.app.tui.chat_screen import ChatScreen
from tandem.app.tui.modals import (
    Confirm,
    HelpScreen,
    ModelPicker,
    NoModelScreen,
    SettingsScreen,
    TextPrompt,
)
from tandem.app.tui.session import ChatSettings
from tandem.app.tui.widgets import ChatList, MessageView
from tandem.runtime.backends.deferred import DeferredBackend
from tandem.runtime.generate import DoneEvent

pytestmark = pytest.mark.anyio


@pytest.fixture()
def anyio_backend() -> str:
    return "asyncio"




def greedy_reply(model: Path, messages: list[dict], max_tokens: int) -> str:
    """The reply computed outside the app, straight from the engine."""
    from tandem.runtime.backends.llama import LlamaCppBackend
    from tandem.runtime.backends.llama_config import LlamaConfig
    from tandem.runtime.chat import ChatEngine

    with LlamaCppBackend(model, LlamaConfig(n_ctx=2048, n_threads=1)) as target:
        events = list(ChatEngine(target).stream(messages, GREEDY, max_tokens))
    done = events[-1]
    assert isinstance(done, DoneEvent)
    return done.text






def views(screen: ChatScreen) -> list[MessageView]:
    return list(screen.query(MessageView))


async def test_send_streams_a_reply_with_stats(stories260k: Path, tmp_path: Path) -> None:
    app = make_app(stories260k, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(app, pilot)
        await send(pilot, screen, "Once upon a time")
        user, reply = app.history.messages(screen.chat.id)
        assert (user.role, user.content, reply.role, reply.status) == ("user", "Once upon a time",
                                                                       "assistant", COMPLETE)
        expected = greedy_reply(stories260k, [{"role": "user", "content": "Once upon a time"}], 16)
        assert reply.content == expected
        assert reply.stats["generated_tokens"] == 16 and reply.stats["model"] == "stories260K"
        assert set(reply.stats["memory"]) >= {"target", "kv"}
        assert "drafter" not in reply.stats["memory"]  # no drafter model here: model-free drafting holds no weights
        shown = views(screen)
        assert [v.record.role for v in shown] == ["user", "assistant"]
        assert shown[1].query_one(Markdown).source == expected
        stats_line = str(shown[1].query_one(".stats", Static).render())
        assert "TTFT --" in stats_line and "16 tokens" in stats_line and "KV" in stats_line
        assert screen.chat.title == "Once upon a time"
        assert screen.input.text == ""


async def test_speculative_reply_is_lossless_and_shows_acceptance(stories260k: Path,
                                                                   tmp_path: Path) -> None:
    app = make_app(stories260k, tmp_path, max_tokens=24, drafter=stories260k, measure_cost=False)
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(app, pilot)
        assert screen.engine.drafter is not None
        await send(pilot, screen, "Once upon a time")
        reply = app.history.messages(screen.chat.id)[-1]
        expected = greedy_reply(stories260k, [{"role": "user", "content": "Once upon a time"}], 24)
        assert reply.content == expected  # speculative decoding is lossless
        stats = reply.stats
        assert stats["drafted_tokens"] > 0 and stats["acceptance_rate"] is not None
        # The drafter stores the target's vocabulary, so it loads when first asked for a
        # draft: its memory counts from then on (here the model-free sources drafted).
        drafter = screen.engine.drafter
        assert isinstance(drafter, DeferredBackend)
        assert stats["drafter"] == "stories260K" and (stats["memory"]["drafter"] > 0) is drafter.is_open
        spans = stats["drafted_spans"]
        assert spans and all(0 <= a < b <= len(reply.content) for a, b in spans)
        view = views(screen)[1]
        line = str(view.query_one(".stats", Static).render())
        assert "accept" in line and "tok/call" in line
        assert (f"+ drafter {'' if drafter.is_open else 'not loaded'}") in line
        assert "+ stories260K" in str(view.query_one(".role", Label).render())
        await pilot.press("f4")
        coloured = view.query_one(".drafted", Static).visual
        assert sorted((s.start, s.end) for s in coloured.spans) == sorted(map(tuple, spans))


async def test_enter_sends_and_ctrl_j_inserts_a_newline(stories260k: Path, tmp_path: Path) -> None:
    app = make_app(stories260k, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(app, pilot)
        await pilot.press("a", "ctrl+j", "b", "shift+enter", "c")
        assert screen.input.text == "a\nb\nc"
        assert screen.chat is None  # nothing sent
        await await_reply(pilot, screen, "enter")
        assert app.history.messages(screen.chat.id)[0].content == "a\nb\nc"


async def test_esc_stops_and_keeps_the_partial_reply(stories260k: Path, tmp_path: Path) -> None:
    app = make_app(stories260k, tmp_path, max_tokens=400)
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(app, pilot)
        screen.engine = SlowEngine(screen.engine)
        screen.input.load_text("Once upon a time")
        await pilot.press("enter")
        await until(pilot, lambda: screen.replies.view is not None
                    and len(screen.replies.view.record.content) > 10)
        # the UI keeps responding while the worker generates
        await pilot.press("x")
        assert screen.input.text == "x"
        await await_reply(pilot, screen, "escape")
        reply = app.history.messages(screen.chat.id)[-1]
        assert reply.status == INTERRUPTED and 0 < reply.stats["generated_tokens"] < 400
        full = greedy_reply(stories260k, [{"role": "user", "content": "Once upon a time"}], 400)
        assert reply.content and full.startswith(reply.content)
        assert "interrupted" in str(views(screen)[-1].query_one(".role", Label).render())


async def test_quit_mid_reply_is_clean(stories260k: Path, tmp_path: Path) -> None:
    app = make_app(stories260k, tmp_path, max_tokens=400)
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(app, pilot)
        screen.engine = SlowEngine(screen.engine)
        screen.input.load_text("Once upon a time")
        await pilot.press("enter")
        await until(pilot, lambda: screen.replies.view is not None
                    and len(screen.replies.view.record.content) > 5)
        chat_id = screen.chat.id
        await pilot.press("ctrl+q")
    assert app.return_code == 0
    with History(app.history.path) as h:
        reply = h.messages(chat_id)[-1]
        assert reply.status == INTERRUPTED and reply.content
        assert reply.stats["finish_reason"] == "cancelled"


async def test_regenerate_replaces_the_last_reply(stories260k: Path, tmp_path: Path) -> None:
    app = make_app(stories260k, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(app, pilot)
        await send(pilot, screen, "Once upon a time")
        first = app.history.messages(screen.chat.id)[-1]
        await await_reply(pilot, screen, "ctrl+r")
        msgs = app.history.messages(screen.chat.id)
        assert len(msgs) == 2 and msgs[-1].created_at > first.created_at
        assert msgs[-1].content == first.content  # greedy: the same reply again
        assert len(views(screen)) == 2


async def test_edit_and_resend(stories260k: Path, tmp_path: Path) -> None:
    app = make_app(stories260k, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(app, pilot)
        await send(pilot, screen, "Once upon a time")
        await pilot.press("ctrl+e")
        assert screen.input.text == "Once upon a time"
        assert screen.query_one("#edit-banner").display
        await pilot.press("escape")  # cancel the edit
        assert screen.editing is None and screen.input.text == ""
        await pilot.press("ctrl+e")
        await send(pilot, screen, "The cat sat")
        assert [v.record.content for v in views(screen)][0] == "The cat sat"
        msgs = app.history.messages(screen.chat.id)
        assert [m.content for m in msgs][0] == "The cat sat" and len(msgs) == 2
        expected = greedy_reply(stories260k, [{"role": "user", "content": "The cat sat"}], 16)
        assert msgs[1].content == expected


async def test_new_chat_and_switching(stories260k: Path, tmp_path: Path) -> None:
    app = make_app(stories260k, tmp_path, max_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(app, pilot)
        await send(pilot, screen, "first chat")
        first = screen.chat.id
        await pilot.press("ctrl+n")
        assert screen.chat is None and views(screen) == []
        await send(pilot, screen, "second chat")
        chat_list = screen.query_one(ChatList)
        assert [chat_list.get_option_at_index(i).prompt for i in range(chat_list.option_count)] == [
            "second chat", "first chat"]
        chat_list.focus()
        chat_list.highlighted = 1
        await pilot.press("enter")
        await pilot.pause()
        assert screen.chat.id == first
        assert views(screen)[0].record.content == "first chat"


async def test_rename_and_delete_chat(stories260k: Path, tmp_path: Path) -> None:
    app = make_app(stories260k, tmp_path, max_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(app, pilot)
        await send(pilot, screen, "hello")
        chat_id = screen.chat.id
        await pilot.press("f2")
        assert isinstance(app.screen, TextPrompt)
        app.screen.query_one(Input).value = "Renamed chat"
        await pilot.press("enter")
        await pilot.pause()
        assert app.history.get_chat(chat_id).title == "Renamed chat"
        assert screen.query_one(ChatList).get_option_at_index(0).prompt == "Renamed chat"
        await pilot.press("f8")
        assert isinstance(app.screen, Confirm)
        await pilot.press("n")  # no: nothing deleted
        assert app.history.list_chats()[0].id == chat_id
        await pilot.press("f8", "y")
        await pilot.pause()
        assert app.history.list_chats() == [] and screen.chat is None


async def test_settings_modal_sets_system_prompt_and_sampling(stories260k: Path, tmp_path: Path) -> None:
    app = make_app(stories260k, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(app, pilot)
        await pilot.press("ctrl+o")
        modal = app.screen
        assert isinstance(modal, SettingsScreen)
        modal.query_one("#system-prompt", TextArea).load_text("You tell short stories.")
        modal.query_one("#f-max_tokens", Input).value = "many"
        await pilot.press("ctrl+s")
        assert app.screen is modal  # invalid: stays open and says why
        assert "Max tokens" in str(modal.query_one("#settings-error", Label).render())
        modal.query_one("#f-max_tokens", Input).value = "5"
        modal.query_one("#f-top_k", Input).value = "7"
        modal.query_one("#f-frequency_penalty", Input).value = "9"
        await pilot.press("ctrl+s")
        assert app.screen is modal
        assert "Frequency penalty" in str(modal.query_one("#settings-error", Label).render())
        modal.query_one("#f-frequency_penalty", Input).value = "0"
        modal.query_one("#f-presence_penalty", Input).value = "0.5"
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert app.screen is screen
        chat = app.history.get_chat(screen.chat.id)
        assert chat.system_prompt == "You tell short stories."
        settings = ChatSettings.from_dict(chat.params)
        assert (settings.max_tokens, settings.params.top_k, settings.params.temperature) == (5, 7, 0.0)
        assert settings.params.presence_penalty == 0.5
        await pilot.press("ctrl+o")  # opened again, it shows what was saved
        presence = app.screen.query_one("#f-presence_penalty", Input)
        assert presence.value == "0.5"
        presence.value = "0"  # off again: the reply below is compared with plain greedy decoding
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert app.screen is screen
        assert ChatSettings.from_dict(app.history.get_chat(screen.chat.id).params).params.presence_penalty == 0.0
        await send(pilot, screen, "Once upon a time")
        reply = app.history.messages(screen.chat.id)[-1]
        expected = greedy_reply(stories260k, [{"role": "system", "content": "You tell short stories."},
                                              {"role": "user", "content": "Once upon a time"}], 5)
        assert reply.content == expected and reply.stats["generated_tokens"] == 5


async def test_model_picker_lists_the_store_and_switches(stories260k: Path, tmp_path: Path,
                                                          isolated_home: Path) -> None:
    from tandem.models.paths import models_dir

    copy = models_dir() / "tiny-copy.gguf"
    shutil.copy(stories260k, copy)
    app = make_app(stories260k, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(app, pilot)
        await pilot.press("ctrl+t")
        picker = app.screen
        assert isinstance(picker, ModelPicker)
        targets = picker.query_one("#target-list", OptionList)
        # the model given by path (not in the store) is listed first, highlighted as current
        names = [targets.get_option_at_index(i).prompt for i in range(targets.option_count)]
        assert names == ["stories260K", "tiny-copy"] and targets.highlighted == 0
        targets.highlighted = 1
        await pilot.press("ctrl+s")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert screen.choice.target == copy and screen.engine is not None
        assert "Model tiny-copy" in str(screen.query_one("#status", Label).render())


async def test_export_writes_markdown(stories260k: Path, tmp_path: Path) -> None:
    app = make_app(stories260k, tmp_path, max_tokens=8)
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(app, pilot)
        await send(pilot, screen, "Once upon a time")
        await pilot.press("ctrl+s")
        prompt = app.screen
        assert isinstance(prompt, TextPrompt)
        target = Path(prompt.query_one(Input).value)
        assert target.parent == tmp_path and target.suffix == ".md"
        await pilot.press("enter")
        await pilot.pause()
        assert target.read_text() == app.history.export_markdown(screen.chat.id)
        assert "## Assistant" in target.read_text()


async def test_code_blocks_copy_by_key_and_click(stories260k: Path, tmp_path: Path) -> None:
    with History() as h:  # a stored chat whose reply holds code
        chat = h.create_chat("code")
        h.add_message(chat.id, "user", "show code")
        h.add_message(chat.id, "assistant", "Here:\n\n```python\nprint('hi')\nx = 1\n```\n",
                      stats={"generated_tokens": 9})
    app = make_app(stories260k, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(app, pilot)
        assert views(screen)[1].code_blocks() == ["print('hi')\nx = 1"]
        await pilot.press("f5")
        assert app.clipboard == "print('hi')\nx = 1"
        app.copy_to_clipboard("")
        from textual.widgets.markdown import MarkdownFence

        await pilot.click(MarkdownFence)
        assert app.clipboard == "print('hi')\nx = 1"


async def test_drafted_colouring_toggle(stories260k: Path, tmp_path: Path) -> None:
    with History() as h:
        chat = h.create_chat("spec")
        h.add_message(chat.id, "user", "go")
        h.add_message(chat.id, "assistant", "abcdef",
                      stats={"generated_tokens": 3, "drafted_spans": [[0, 2], [4, 6]]})
    app = make_app(stories260k, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(app, pilot)
        reply = views(screen)[1]
        assert reply.query_one(Markdown).display and not reply.query_one(".drafted", Static).display
        await pilot.press("f4")
        assert not reply.query_one(Markdown).display and reply.query_one(".drafted", Static).display
        text = reply.query_one(".drafted", Static).visual
        spans = sorted((s.start, s.end) for s in text.spans)
        assert spans == [(0, 2), (4, 6)]


async def test_help_screen_and_autocomplete_hook(stories260k: Path, tmp_path: Path) -> None:
    app = make_app(stories260k, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(app, pilot)
        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)
        source = app.screen.query_one(Markdown).source
        assert "ctrl+r" in source and "Regenerate" in source and "ctrl+j" in source
        await pilot.press("escape")
        assert app.screen is screen
        await pilot.press("f9")  # issue 5's pane, or a clear note when it is not there
        await pilot.pause()
        try:
            import tandem.app.tui.autocomplete_screen  # noqa: F401
        except ModuleNotFoundError:
            assert any("Autocomplete" in n.message for n in app._notifications)
        else:
            assert type(app.screen).__name__ == "AutocompleteScreen"
            await pilot.press("escape")
            await app.workers.wait_for_complete()
            await pilot.pause()
            assert app.screen is screen


async def test_first_run_without_models_explains_what_to_do(tmp_path: Path) -> None:
    app = make_app(None, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert isinstance(app.screen, NoModelScreen)
        text = app.screen.query_one(Markdown).source
        assert "tandem pull" in text and "TANDEM_MODEL_PATH" in text
        await pilot.press("q")
    assert app.return_code == 0


async def test_reopening_shows_stored_chats_and_stats(stories260k: Path, tmp_path: Path) -> None:
    app = make_app(stories260k, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(app, pilot)
        await send(pilot, screen, "Once upon a time")
        stored = app.history.messages(screen.chat.id)
    again = make_app(stories260k, tmp_path)
    async with again.run_test(size=SIZE) as pilot:
        screen = await ready(again, pilot)
        shown = views(screen)
        assert [v.record.content for v in shown] == [m.content for m in stored]
        assert "16 tokens" in str(shown[1].query_one(".stats", Static).render())


@pytest.mark.parametrize("args", [["chat", "-m", "no-such-model"]])
def test_cli_bad_model_is_one_clear_error(args: list[str], capsys) -> None:
    from tandem.app.cli import main

    assert main(args) != 0
    err = capsys.readouterr().err
    assert "No model 'no-such-model'" in err and "Traceback" not in err
