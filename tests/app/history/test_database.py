"""The SQLite chat store: schema, chats, incremental replies, export, bad files."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from sqlite_file import integrity_ok, pragma

from tandem.app.history.database import (
    COMPLETE,
    INTERRUPTED,
    History,
    chat_markdown,
    default_path,
)
from tandem.app.history.schema import MIGRATIONS, SCHEMA_VERSION
from tandem.app.tui.session import ChatSettings, LiveStats, conversation, drafted_chars, title_from
from tandem.errors import TandemError
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.generate import TokenEvent


@pytest.fixture()
def history(tmp_path: Path):
    h = History(tmp_path / "chats.sqlite3")
    yield h
    h.close()


def test_default_location_is_the_data_dir(isolated_home: Path) -> None:
    with History() as h:
        assert h.path == default_path()
        assert str(h.path).startswith(str(isolated_home))


def test_wal_mode_and_schema_version(history: History) -> None:
    raw = sqlite3.connect(history.path)
    assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == len(MIGRATIONS)
    assert integrity_ok(history.path)


def test_chat_crud_and_order(history: History) -> None:
    a = history.create_chat("first", system_prompt="Be brief.", params={"temperature": 0.2},
                            model="m", drafter="d")
    b = history.create_chat("second")
    assert [c.id for c in history.list_chats()] == [b.id, a.id]
    history.add_message(a.id, "user", "hi")  # touching a chat moves it to the top
    assert [c.id for c in history.list_chats()] == [a.id, b.id]
    got = history.get_chat(a.id)
    assert (got.title, got.system_prompt, got.params, got.model, got.drafter) == (
        "first", "Be brief.", {"temperature": 0.2}, "m", "d")
    renamed = history.update_chat(a.id, title="renamed", params={"top_k": 5})
    assert (renamed.title, renamed.params) == ("renamed", {"top_k": 5})
    with pytest.raises(ValueError):
        history.update_chat(a.id, created_at=0)
    history.delete_chat(a.id)
    assert [c.id for c in history.list_chats()] == [b.id]
    assert history.messages(a.id) == []  # messages cascade with their chat
    with pytest.raises(TandemError):
        history.get_chat(a.id)


def test_reply_is_committed_fragment_by_fragment(history: History) -> None:
    chat = history.create_chat()
    reply = history.start_reply(chat.id)
    assert reply.status == INTERRUPTED and reply.content == ""
    reader = sqlite3.connect(history.path)  # another connection sees each commit at once
    for i, part in enumerate(["Once", " upon", " a time"]):
        history.append(reply.id, part)
        seen = reader.execute("SELECT content FROM messages WHERE id = ?", (reply.id,)).fetchone()[0]
        assert seen == "".join(["Once", " upon", " a time"][: i + 1])
    history.finish_reply(reply.id, COMPLETE, {"generated_tokens": 3})
    done = history.get_message(reply.id)
    assert (done.status, done.stats) == (COMPLETE, {"generated_tokens": 3})


def test_delete_from_drops_later_messages(history: History) -> None:
    chat = history.create_chat()
    ids = [history.add_message(chat.id, r, t).id
           for r, t in [("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d")]]
    other = history.create_chat()
    kept = history.add_message(other.id, "user", "x")
    assert history.delete_from(chat.id, ids[2]) == 2
    assert [m.content for m in history.messages(chat.id)] == ["a", "b"]
    assert history.messages(other.id) == [kept]


def test_bad_role_and_status_are_refused(history: History) -> None:
    chat = history.create_chat()
    with pytest.raises(ValueError):
        history.add_message(chat.id, "robot", "x")
    with pytest.raises(ValueError):
        history.finish_reply(history.start_reply(chat.id).id, "done")


def test_export_markdown(history: History) -> None:
    chat = history.create_chat("Stories", system_prompt="Tell stories.", params={"temperature": 0.0},
                               model="stories260K")
    history.add_message(chat.id, "user", "Once upon a time")
    reply = history.start_reply(chat.id)
    history.append(reply.id, "there was a cat")
    text = history.export_markdown(chat.id)
    assert text.startswith("# Stories\n")
    assert "- Model: `stories260K`" in text and "temperature=0.0" in text
    sections = [s.split("\n", 1)[0] for s in text.split("\n## ")[1:]]
    assert sections == ["System", "User", "Assistant (interrupted)"]
    assert text.endswith("there was a cat\n")
    assert text == chat_markdown(history.get_chat(chat.id), history.messages(chat.id))


def test_old_schema_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    sqlite3.connect(path).close()  # a version-0 (empty) database
    with History(path) as h:
        assert pragma(path, "user_version") == SCHEMA_VERSION
        assert h.create_chat().id == 1


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "new.sqlite3"
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(TandemError, match="newer Tandem"):
        History(path)


def test_not_a_database_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "junk.sqlite3"
    path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(TandemError, match="cannot be opened"):
        History(path)


# -- the pure helpers the app builds on ------------------------------------------------
def test_settings_round_trip_and_tolerate_unknown_keys() -> None:
    s = ChatSettings(SamplingParams(temperature=0.3, top_k=7, seed=5), 99)
    assert ChatSettings.from_dict(s.to_dict()) == s
    assert ChatSettings.from_dict({"temperature": 0.1, "from_the_future": 1}).params.temperature == 0.1
    assert ChatSettings.from_dict(None) == ChatSettings()


def test_conversation_puts_the_system_prompt_first_and_skips_empty_replies(history: History) -> None:
    chat = history.create_chat(system_prompt="Be kind.")
    history.add_message(chat.id, "user", "hi")
    history.start_reply(chat.id)  # empty interrupted reply: nothing for the model to see
    msgs = conversation(history.get_chat(chat.id), history.messages(chat.id))
    assert msgs == [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "hi"}]


def test_title_from_first_line() -> None:
    assert title_from("  hello   world \nsecond") == "hello world"
    long = title_from("x" * 100, width=10)
    assert len(long) == 10 and long.endswith("…")


def test_drafted_spans_merge_and_count_characters() -> None:
    live = LiveStats()
    token_bytes = {1: b"ab", 2: b"c", 3: b"de"}.__getitem__
    events = [TokenEvent("abc", [1, 2], drafted=1), TokenEvent("de", [3], drafted=1),
              TokenEvent("c", [2], drafted=0)]
    counts = [drafted_chars(e, token_bytes) for e in events]
    assert counts == [2, 2, 0]
    for e, n in zip(events, counts, strict=True):
        live.on_token(e, n, now=1.0)
    # "ab" drafted, "c" from the target, "de" drafted, "c" from the target
    assert live.drafted_spans == [[0, 2], [3, 5]]
    assert live.tokens == 4 and live.drafted == 2 and live.chars == 6
