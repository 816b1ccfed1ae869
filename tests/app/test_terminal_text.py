"""Model text shown on a terminal carries no escape sequences or control characters
(`tandem run`, the chat app); JSON output and the database keep it verbatim."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tandem.app.terminal_text import StreamCleaner, mask_controls, strip_controls

OSC_TITLE = "\x1b]0;pwned\x07"
NASTY = f"Hi {OSC_TITLE}there\x1b[2J\x1b[31mred\x1b[0m\r\x08\x9b1;1H\x1bP1$r\x1b\\ok\x1b]52;c;aGVsbG8=\x1b\\!\n\tend"


def test_strip_controls_removes_sequences_and_controls() -> None:
    assert strip_controls(NASTY) == "Hi thereredok!\n\tend"
    assert strip_controls("plain text, ünïcödé 🙂\n\tok") == "plain text, ünïcödé 🙂\n\tok"


def test_mask_controls_keeps_offsets() -> None:
    masked = mask_controls(NASTY)
    assert len(masked) == len(NASTY)
    assert "\x1b" not in masked and "\x07" not in masked and "\x9b" not in masked


CONTROL = st.characters(min_codepoint=0, max_codepoint=0x9F)
TEXT = st.text(st.one_of(CONTROL, st.sampled_from(list("[]();P\\0123456789abc ?$"))), max_size=60)


@given(TEXT)
def test_no_control_survives(text: str) -> None:
    out = strip_controls(text)
    assert not any(ord(c) < 32 and c not in "\n\t" or 0x7F <= ord(c) <= 0x9F for c in out)


@given(TEXT, st.lists(st.integers(0, 60), max_size=6))
def test_stream_cleaner_equals_whole_text_cleaning(text: str, cuts: list[int]) -> None:
    """However the text is split into fragments, the cleaned stream has no controls."""
    cleaner = StreamCleaner()
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    out = "".join(cleaner.feed(p) for p in pieces) + cleaner.flush()
    assert out == strip_controls(out)


def test_stream_cleaner_char_by_char_equals_whole_text() -> None:
    cleaner = StreamCleaner()
    assert "".join(cleaner.feed(c) for c in NASTY) + cleaner.flush() == strip_controls(NASTY)


def test_stream_cleaner_holds_a_split_sequence() -> None:
    c = StreamCleaner()
    assert c.feed("Hello \x1b") == "Hello "
    assert c.feed("]0;ti") == ""
    assert c.feed("tle\x07 world") == " world"
    assert c.feed("\x1b[") == ""
    assert c.feed("1mbold") == "bold"
    assert c.flush() == ""


def _escaping_generate(real):
    """``generate`` whose token texts carry escape sequences (a model that emits them)."""
    from tandem.runtime.generate import DoneEvent, TokenEvent

    def gen(*args, **kwargs):
        texts = []
        for ev in real(*args, **kwargs):
            if isinstance(ev, TokenEvent):
                ev = dataclasses.replace(ev, text=ev.text + "\x1b]0;pwned\x07")
                texts.append(ev.text)
            elif isinstance(ev, DoneEvent):
                ev = dataclasses.replace(ev, text="".join(texts))
            yield ev
    return gen


def test_tandem_run_strips_escapes_but_json_keeps_them(stories260k: Path, monkeypatch, capsys) -> None:
    from tandem.app.cli import main
    from tandem.app.commands import run as cmd_run

    monkeypatch.setattr(cmd_run, "generate", _escaping_generate(cmd_run.generate))
    argv = ["run", "-m", str(stories260k), "-p", "Once upon a time", "-n", "4", "--quiet", "--draft-mode", "off"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.strip() and "\x1b" not in out and "\x07" not in out and "]0;pwned" not in out
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["text"].count("\x1b]0;pwned\x07") == 4  # verbatim in JSON


@pytest.mark.anyio
async def test_chat_app_shows_a_stored_reply_without_escapes(stories260k: Path, tmp_path: Path) -> None:
    from textual.widgets import Markdown

    from tandem.app.history.database import History
    from tandem.app.tui.app import AppConfig, TandemApp
    from tandem.app.tui.widgets import ChatList, MessageView

    db = tmp_path / "chats.sqlite3"
    with History(db) as h:
        chat = h.create_chat(f"title {OSC_TITLE}")
        h.add_message(chat.id, "user", "hello")
        h.add_message(chat.id, "assistant", f"Reply {OSC_TITLE}with \x1b[2Jescapes")
    app = TandemApp(AppConfig(model=stories260k, history_path=db, export_dir=tmp_path, threads=1))
    async with app.run_test(size=(100, 32)) as pilot:
        await app.workers.wait_for_complete()
        await pilot.pause()
        screen = app.screen
        await screen.open_chat(chat.id)
        await pilot.pause()
        shown = [v for v in screen.query(MessageView) if v.record.role == "assistant"]
        assert shown, "the stored chat is not shown"
        body = shown[0].query_one(".body", Markdown).source
        assert body == "Reply with escapes"
        assert shown[0].record.content == f"Reply {OSC_TITLE}with \x1b[2Jescapes"  # the record is verbatim
        titles = [str(o.prompt) for o in screen.query_one(ChatList).options]
        assert all("\x1b" not in t and "\x07" not in t for t in titles)
    with History(db) as h:
        assert h.messages(chat.id)[-1].content == f"Reply {OSC_TITLE}with \x1b[2Jescapes"


@pytest.fixture()
def anyio_backend() -> str:
    return "asyncio"
