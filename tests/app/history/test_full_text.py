"""Conversation search (SQLite FTS5) and the per-chat model record, on real SQLite files."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from sqlite_file import integrity_ok, pragma

from tandem.app.history.database import COMPLETE, INTERRUPTED, History
from tandem.app.history.full_text import HIT_END, HIT_START, fts_query
from tandem.app.history.schema import MIGRATIONS


def test_search_finds_words_across_chats_and_follows_streamed_text(tmp_path: Path) -> None:
    with History(tmp_path / "h.sqlite3") as h:
        poems = h.create_chat("Poems")
        h.add_message(poems.id, "user", "Write a haiku about code")
        reply = h.start_reply(poems.id)
        for fragment in ["Code is ", "a mirror,\nReflecting ", "light"]:
            h.append(reply.id, fragment)  # streamed: indexed once, when the reply finishes
        assert h.search("mirror") == []
        h.finish_reply(reply.id, COMPLETE, {"generated_tokens": 8})
        other = h.create_chat("Shopping")
        h.add_message(other.id, "user", "eggs, milk and a mirror for the hall")

        hits = h.search("mirror")
        assert sorted(x.chat_id for x in hits) == [poems.id, other.id]
        poem_hit = next(x for x in hits if x.chat_id == poems.id)
        assert poem_hit.chat_title == "Poems" and poem_hit.role == "assistant"
        assert f"{HIT_START}mirror{HIT_END}" in poem_hit.snippet

        assert [x.message_id for x in h.search("reflect")] == [reply.id]  # prefix of the last word
        assert h.search("mirror hall")[0].chat_id == other.id  # every word must occur
        assert h.search("nothing here") == []
        assert h.search("   ") == [] and h.search("*:") == []


@pytest.mark.parametrize("query", ['"', 'AND OR NOT', 'a:b', 'NEAR(x y)', '(', "col*umn", "^start"])
def test_search_treats_fts_syntax_as_text(tmp_path: Path, query: str) -> None:
    with History(tmp_path / "h.sqlite3") as h:
        chat = h.create_chat("x")
        h.add_message(chat.id, "user", "AND OR NOT a b column start x y")
        h.search(query)  # never an sqlite3.OperationalError for a malformed query


def test_fts_query_quotes_words_and_prefixes_the_last() -> None:
    assert fts_query("code mirr") == '"code" "mirr"*'
    assert fts_query("code mirror ") == '"code" "mirror"'
    assert fts_query('say "AND"') == '"say" "AND"*'
    assert fts_query("...") == ""


def edit_outside(path: Path, message_id: int, content: str) -> None:
    """Replace a message's text from another connection (the app never rewrites a finished
    message; a user's own tool, or a future edit feature, might): the index must follow."""
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("UPDATE messages SET content = ? WHERE id = ?", (content, message_id))
    finally:
        db.close()


def test_index_follows_edits_and_deletes(tmp_path: Path) -> None:
    with History(tmp_path / "h.sqlite3") as h:
        chat = h.create_chat("x")
        m = h.add_message(chat.id, "assistant", "first draft")
        edit_outside(tmp_path / "h.sqlite3", m.id, "second version")
        assert h.search("first") == [] and [x.message_id for x in h.search("second")] == [m.id]
        later = h.add_message(chat.id, "user", "second thoughts")
        h.delete_from(chat.id, later.id)
        assert [x.message_id for x in h.search("second")] == [m.id]
        h.delete_chat(chat.id)  # cascades to the messages, and the triggers to the index
        assert h.search("second") == []
        assert integrity_ok(h.path)


def test_a_version_1_file_is_migrated_and_its_messages_indexed(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path, isolation_level=None)
    MIGRATIONS[0](db)
    db.execute("PRAGMA user_version=1")
    db.execute("INSERT INTO chats (title, created_at, updated_at, model) VALUES ('Old', 0, 0, 'm')")
    db.execute("INSERT INTO messages (chat_id, role, content, created_at) VALUES (1, 'user', 'ancient words', 0)")
    db.close()
    with History(path) as h:
        assert pragma(path, "user_version") == len(MIGRATIONS) >= 2
        assert [x.chat_title for x in h.search("ancient")] == ["Old"]
        assert h.get_chat(1).engine is None


def test_chat_engine_record_round_trips(tmp_path: Path) -> None:
    engine = {"target": str(tmp_path / "t.gguf"), "drafter": None, "draft_mode": "ngram"}
    with History(tmp_path / "h.sqlite3") as h:
        chat = h.create_chat("x")
        assert h.update_chat(chat.id, engine=engine).engine == engine
    with History(tmp_path / "h.sqlite3") as h:
        assert h.get_chat(chat.id).engine == engine


def test_a_reply_cut_by_esc_or_a_crash_is_searchable(tmp_path: Path) -> None:
    path = tmp_path / "h.sqlite3"
    with History(path) as h:
        chat = h.create_chat("x")
        stopped = h.start_reply(chat.id)
        h.append(stopped.id, "stopped by escape")
        h.finish_reply(stopped.id, INTERRUPTED, {"finish_reason": "cancelled"})
        crashed = h.start_reply(chat.id)
        h.append(crashed.id, "the process died here")  # no finish_reply: kill -9
        assert [x.message_id for x in h.search("escape")] == [stopped.id]
    with History(path) as h:  # the next open indexes what the dead writer left
        assert [x.message_id for x in h.search("died")] == [crashed.id]
        h.finish_reply(crashed.id, COMPLETE, None)
        edit_outside(path, crashed.id, "edited afterwards")  # an edit of a finished message
        assert h.search("died") == [] and [x.message_id for x in h.search("edited")] == [crashed.id]
        assert integrity_ok(h.path)
