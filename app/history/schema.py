"""The chat history's SQLite schema and its migrations, one function per version.

``MIGRATIONS[i]`` upgrades a database at version ``i`` (``PRAGMA user_version``) to
``i + 1``; :class:`tandem.app.history.database.History` runs the missing ones when it opens
a file, all in one write transaction that also reads the version they start from (so a
file is never left between versions, and two openers never run a step twice). Append
new versions, never edit old ones: files in the field were written by them.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable


def _run_script(db: sqlite3.Connection, script: str) -> None:
    """Run statements one by one: ``executescript`` would commit the open migration transaction."""
    for statement in script.split(";"):
        if statement.strip():
            db.execute(statement)


def _schema_v1(db: sqlite3.Connection) -> None:
    _run_script(
        db,
        """
        CREATE TABLE chats (
            id INTEGER PRIMARY KEY,
            title TEXT NOT NULL,
            system_prompt TEXT NOT NULL DEFAULT '',
            params TEXT NOT NULL DEFAULT '{}',
            model TEXT,
            drafter TEXT,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL
        );
        CREATE TABLE messages (
            id INTEGER PRIMARY KEY,
            chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
            role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
            content TEXT NOT NULL DEFAULT '',
            stats TEXT,
            status TEXT NOT NULL DEFAULT 'complete' CHECK (status IN ('complete', 'interrupted')),
            created_at REAL NOT NULL
        );
        CREATE INDEX messages_by_chat ON messages(chat_id, id);
        """
    )


def _schema_v2(db: sqlite3.Connection) -> None:
    """Full-text search over messages (FTS5, kept in sync by triggers) and the model,
    drafter and draft mode a chat last used, as paths, so reopening it can restore them.

    The index is an external-content FTS5 table: it stores only the index, the text stays
    in ``messages``. Every write to ``messages`` (streamed fragments included) updates it
    in the same transaction, so search never disagrees with what is stored.
    """
    for statement in (
        "CREATE VIRTUAL TABLE messages_fts USING fts5(content, content='messages', content_rowid='id',"
        " tokenize='unicode61 remove_diacritics 2')",
        "CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN"
        " INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content); END",
        "CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN"
        " INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content); END",
        "CREATE TRIGGER messages_fts_update AFTER UPDATE OF content ON messages BEGIN"
        " INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content);"
        " INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content); END",
        "INSERT INTO messages_fts(messages_fts) VALUES ('rebuild')",
        "ALTER TABLE chats ADD COLUMN engine TEXT",
    ):
        db.execute(statement)


def _schema_v3(db: sqlite3.Connection) -> None:
    """The search index rebuilt for streaming and typing.

    * Its own copy of the text (not external content), so a row can be dropped without
      handing FTS5 the exact text it indexed. That lets a streaming reply skip
      re-indexing on every fragment: it is indexed when it finishes (its status is
      set) and at the next open if a crash came first (:meth:`History._reindex_unfinished`).
      Re-indexing per fragment cost ~2 ms per token late in a 2,000-token reply.
    * Prefix indexes for 1-3 characters: search runs on every keystroke, and a short
      prefix (``t*``) otherwise expands to most of the vocabulary (3.3 s on 10,000
      messages; 73 ms with the prefix index).
    """
    for statement in (
        "DROP TRIGGER messages_fts_insert",
        "DROP TRIGGER messages_fts_delete",
        "DROP TRIGGER messages_fts_update",
        "DROP TABLE messages_fts",
        "CREATE VIRTUAL TABLE messages_fts USING fts5(content, tokenize='unicode61 remove_diacritics 2',"
        " prefix='1 2 3')",
        "INSERT INTO messages_fts(rowid, content) SELECT id, content FROM messages",
        "CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN"
        " INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content); END",
        "CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN"
        " DELETE FROM messages_fts WHERE rowid = old.id; END",
        # an edit of a finished message; streamed fragments land on 'interrupted' rows
        "CREATE TRIGGER messages_fts_edit AFTER UPDATE OF content ON messages WHEN new.status = 'complete' BEGIN"
        " DELETE FROM messages_fts WHERE rowid = old.id;"
        " INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content); END",
        # a reply finishing (complete, or interrupted by Esc): index what it holds now
        "CREATE TRIGGER messages_fts_finish AFTER UPDATE OF status ON messages BEGIN"
        " DELETE FROM messages_fts WHERE rowid = old.id;"
        " INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content); END",
    ):
        db.execute(statement)


MIGRATIONS: list[Callable[[sqlite3.Connection], None]] = [_schema_v1, _schema_v2, _schema_v3]
"""``MIGRATIONS[i]`` upgrades a database at version ``i`` to ``i + 1``; append, never edit."""
SCHEMA_VERSION = len(MIGRATIONS)
