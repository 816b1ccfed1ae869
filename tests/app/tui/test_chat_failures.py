"""The chat app never wedges and loses nothing: a reply that fails mid-way ends with a
visible error and its partial text stored; a locked database at send keeps the typed
message; a damaged history file is set aside with a notice; an unusable data folder is
one error line. Pilot tests against the real fixture model and real SQLite files."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tui_pilot import SIZE, ready, until
from tui_pilot import make_app as pilot_app

from tandem.app.history.database import COMPLETE, INTERRUPTED, History
from tandem.app.tui.app import TandemApp
from tandem.app.tui.widgets import MessageView
from tandem.runtime.generate import TokenEvent

pytestmark = pytest.mark.anyio


@pytest.fixture()
def anyio_backend() -> str:
    return "asyncio"


def make_app(model: Path, tmp_path: Path, history: Path | None = None, max_tokens: int = 24) -> TandemApp:
    return pilot_app(model, tmp_path, max_tokens, history_path=history or tmp_path / "chats.sqlite3")


class Failing:
    """A real engine whose stream fails after ``after`` tokens (``fail`` is called then)."""

    def __init__(self, engine, after: int, fail) -> None:
        self.engine, self.after, self.fail = engine, after, fail

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def stream(self, *args, **kwargs) -> Iterator:
        n = 0
        for event in self.engine.stream(*args, **kwargs):
            if isinstance(event, TokenEvent):
                if n == self.after:
                    self.fail()
                n += 1
            yield event


def _raise_runtime() -> None:
    raise RuntimeError("native failure in the middle of a reply")


async def test_failure_mid_reply_ends_it_with_an_error_and_keeps_the_text(stories260k: Path, tmp_path: Path) -> None:
    app = make_app(stories260k, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(app, pilot)
        real = screen.engine
        screen.engine = Failing(real, 5, _raise_runtime)
        done = screen.replies_done
        screen.input.load_text("Once upon a time")
        await pilot.press("enter")
        await until(pilot, lambda: screen.replies_done > done)
        assert not screen.generating  # not stuck in "generating"
        assert "RuntimeError" in str(screen.query_one("#status").render())
        reply = app.history.messages(screen.chat.id)[-1]
        assert reply.role == "assistant" and reply.status == INTERRUPTED
        assert reply.content  # the 5 tokens streamed before the failure
        shown = [v for v in screen.query(MessageView) if v.record.role == "assistant"]
        assert shown[-1].record.content == reply.content
        # and the app still works: the next message gets a normal reply
        screen.engine = real
        done = screen.replies_done
        screen.input.load_text("The end")
        await pilot.press("enter")
        await until(pilot, lambda: screen.replies_done > done)
        assert app.history.messages(screen.chat.id)[-1].status == COMPLETE


async def test_locked_database_mid_reply_does_not_wedge(stories260k: Path, tmp_path: Path) -> None:
    """Another process takes the database while a reply streams: the reply ends with an
    error instead of leaving the app generating forever; what was stored stays stored."""
    db = tmp_path / "chats.sqlite3"
    app = make_app(stories260k, tmp_path, db)
    other = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(app, pilot)
        app.history._db.execute("PRAGMA busy_timeout=200")  # fail fast instead of after 10 s
        screen.engine = Failing(screen.engine, 3, lambda: other.execute("BEGIN EXCLUSIVE"))
        done = screen.replies_done
        screen.input.load_text("Once upon a time")
        await pilot.press("enter")
        await until(pilot, lambda: screen.replies_done > done)
        assert not screen.generating
        assert "locked" in str(screen.query_one("#status").render())
        other.execute("ROLLBACK")
        reply = app.history.messages(screen.chat.id)[-1]
        assert reply.role == "assistant" and reply.status == INTERRUPTED and reply.content
    other.close()


async def test_locked_database_at_send_keeps_the_typed_message(stories260k: Path, tmp_path: Path) -> None:
    db = tmp_path / "chats.sqlite3"
    app = make_app(stories260k, tmp_path, db)
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(app, pilot)
        app.history._db.execute("PRAGMA busy_timeout=200")
        other = sqlite3.connect(db, isolation_level=None)
        other.execute("BEGIN EXCLUSIVE")
        screen.input.load_text("my carefully typed question")
        await pilot.press("enter")
        await pilot.pause()
        assert screen.input.text == "my carefully typed question"
        assert not screen.generating
        other.execute("ROLLBACK")
        other.close()
        done = screen.replies_done
        await pilot.press("enter")  # the disk is free again: the same text goes through
        await until(pilot, lambda: screen.replies_done > done)
        assert [m.content for m in app.history.messages(screen.chat.id)][0] == "my carefully typed question"
        assert screen.input.text == ""


def _fill_disk(history: History) -> None:
    """SQLite's own "database or disk is full": no page may be added to the file any more."""
    db = history._db
    db.execute("CREATE TABLE IF NOT EXISTS filler (x BLOB)")
    pages = db.execute("PRAGMA page_count").fetchone()[0]
    db.execute(f"PRAGMA max_page_count={pages}")
    for size in (512, 64, 8, 1):  # use up the free space left in the last pages too
        try:
            while True:
                db.execute(f"INSERT INTO filler VALUES (randomblob({size}))")
        except sqlite3.OperationalError as exc:
            assert "full" in str(exc)


async def test_disk_full_at_send_keeps_the_typed_message(stories260k: Path, tmp_path: Path) -> None:
    app = make_app(stories260k, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(app, pilot)
        _fill_disk(app.history)
        screen.input.load_text("a question " * 400)  # needs new pages
        await pilot.press("enter")
        await pilot.pause()
        assert screen.input.text == "a question " * 400 and not screen.generating
        app.history._db.execute("PRAGMA max_page_count=1073741823")  # room again: the same text goes through
        app.history._db.execute("DELETE FROM filler")
        done = screen.replies_done
        await pilot.press("enter")
        await until(pilot, lambda: screen.replies_done > done)
        assert app.history.messages(screen.chat.id)[0].content == "a question " * 400


async def test_disk_full_mid_reply_ends_it_and_keeps_the_text(stories260k: Path, tmp_path: Path) -> None:
    """SQLite's "database or disk is full" while a reply streams: the reply ends with the
    error shown, the text streamed so far stays on screen and in the file, and once
    there is room again Esc and the next message work as usual."""
    db = tmp_path / "chats.sqlite3"
    with History(db) as h:  # an older chat fills most of the messages table's page, so the
        old = h.create_chat("older")  # growing reply needs a new page after ~40 tokens
        h.add_message(old.id, "user", "q" * 3800)
    app = make_app(stories260k, tmp_path, db, max_tokens=200)
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(app, pilot)
        await screen.action_new_chat()
        real = screen.engine
        screen.engine = Failing(real, 3, lambda: _fill_disk(app.history))
        done = screen.replies_done
        screen.input.load_text("Once upon a time")
        await pilot.press("enter")
        await until(pilot, lambda: screen.replies_done > done)
        assert not screen.generating  # not wedged in "generating"
        status = str(screen.query_one("#status").render())
        assert "disk is full" in status and "Traceback" not in status
        reply = app.history.messages(screen.chat.id)[-1]
        assert reply.role == "assistant" and reply.status == INTERRUPTED
        assert len(reply.content) > 12  # what was written before the disk filled up is stored ...
        shown = [v for v in screen.query(MessageView) if v.record.role == "assistant"]
        assert shown[-1].record.content == reply.content  # ... and shown, marked interrupted
        assert shown[-1].record.status == INTERRUPTED
        app.history._db.execute("DELETE FROM filler")  # room again
        app.history._db.execute("PRAGMA max_page_count=1073741823")
        screen.engine = real
        await pilot.press("escape")  # nothing to stop: harmless
        done = screen.replies_done
        screen.input.load_text("The end")
        await pilot.press("enter")
        await until(pilot, lambda: screen.replies_done > done)
        messages = app.history.messages(screen.chat.id)
        assert [m.role for m in messages] == ["user", "assistant", "user", "assistant"]
        assert messages[1].content == reply.content and messages[-1].status == COMPLETE


def _damage_page(path: Path, page: int) -> None:
    with open(path, "r+b") as f:
        f.seek(4096 * (page - 1))  # the b-tree page header
        f.write(b"\xde\xad\xbe\xef" * 8)


@pytest.mark.parametrize("page", [2, 3, 4])
async def test_damaged_history_is_set_aside_with_a_notice(stories260k: Path, tmp_path: Path, page: int) -> None:
    db = tmp_path / "chats.sqlite3"
    with History(db) as h:
        for i in range(30):
            chat = h.create_chat(f"chat {i}")
            h.add_message(chat.id, "user", "hello " * 200)
        h._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    _damage_page(db, page)
    app = make_app(stories260k, tmp_path, db)
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(app, pilot)
        assert "damaged" in (app.history_notice or "")
        assert app.history.list_chats() == []  # a fresh history
        screen.input.load_text("Once upon a time")
        done = screen.replies_done
        await pilot.press("enter")
        await until(pilot, lambda: screen.replies_done > done)
    kept = [p for p in tmp_path.iterdir()
            if p.name.startswith("chats.sqlite3.damaged-") and p.name[-4:] not in ("-wal", "-shm")]
    assert len(kept) == 1  # the damaged file is kept, not deleted


async def test_bad_json_and_unknown_role_do_not_crash(stories260k: Path, tmp_path: Path) -> None:
    db = tmp_path / "chats.sqlite3"
    with History(db) as h:
        chat = h.create_chat("broken")
        h.add_message(chat.id, "user", "hi")
        reply = h.add_message(chat.id, "assistant", "hello there", stats={"model": "x"})
    raw = sqlite3.connect(db)
    raw.execute("UPDATE chats SET params = '{not json' WHERE id = ?", (chat.id,))
    raw.execute("UPDATE messages SET stats = '[1, 2' WHERE id = ?", (reply.id,))
    raw.execute("PRAGMA ignore_check_constraints=ON")
    raw.execute("INSERT INTO messages(chat_id, role, content, status, created_at) VALUES (?, 'robot', 'beep', ?, 0)",
                (chat.id, COMPLETE))
    raw.commit()
    raw.close()
    app = make_app(stories260k, tmp_path, db)
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(app, pilot)
        await screen.open_chat(chat.id)
        await pilot.pause()
        contents = [v.record.content for v in screen.query(MessageView)]
        assert contents == ["hi", "hello there", "beep"]


@pytest.mark.parametrize("argv", [["models"], ["chat"], ["run", "-m", "x", "-p", "hi"], ["serve", "-m", "x"]])
def test_unusable_data_folder_is_one_error_line(tmp_path: Path, argv: list[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    env = {**__import__("os").environ, "TANDEM_HOME": str(blocker / "home")}
    p = subprocess.run([sys.executable, "-m", "tandem.app.cli", *argv], capture_output=True, text=True,
                       timeout=120, env=env)
    assert p.returncode != 0
    assert "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tandem: error:"), p.stderr
    assert json.dumps(p.stderr)  # printable


def _crash() -> None:
    typed_prompt = "my secret ".upper() + "prompt"  # a local the crash report must not show
    raise ValueError(f"boom ({len(typed_prompt)})")


async def test_crash_report_shows_no_locals(stories260k: Path, tmp_path: Path, capsys) -> None:
    app = make_app(stories260k, tmp_path)
    with pytest.raises(ValueError, match="boom"):
        async with app.run_test(size=SIZE) as pilot:
            await ready(app, pilot)
            app.call_later(_crash)
            await pilot.pause()
    report = capsys.readouterr().err  # Textual prints the crash report when the app exits
    assert "boom" in report and "Traceback" in report
    assert "MY SECRET prompt" not in report
    assert app.return_code == 1
