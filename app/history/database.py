"""Chat history in SQLite: chats with their settings, and messages written as they stream.

Why SQLite in WAL mode with autocommit: every streamed fragment is its own small
transaction, so a reply cut short by Esc, a crash or ``kill -9`` keeps everything it had
produced, and the database is never left half-written (SQLite's journal guarantees each
transaction is all-or-nothing). ``synchronous=NORMAL`` in WAL mode survives process
crashes (only a power cut can lose the last few commits) and keeps per-fragment commits
cheap.

A reply is inserted with status ``interrupted`` and only marked ``complete`` when the
generation finishes, so whatever kills the process, what is on disk is labelled honestly.

The schema carries a version (``PRAGMA user_version``); the migrations of
:mod:`tandem.app.history.schema` upgrade an older file step by step, and a file from a
newer Tandem is refused with a clear error. Search is :mod:`tandem.app.history.full_text`.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.app.history.full_text import SearchHit, search_messages
from tandem.app.history.schema import MIGRATIONS, SCHEMA_VERSION
from tandem.errors import TandemError
from tandem.models.paths import data_dir

COMPLETE = "complete"
INTERRUPTED = "interrupted"
STATUSES = (COMPLETE, INTERRUPTED)
ROLES = ("system", "user", "assistant")
BUSY_TIMEOUT_S = 10.0
"""How long opening or writing waits for another Tandem's lock before it fails with
"database is locked" (two chats, or a chat and ``tandem chats``, share one file)."""


@dataclass
class ChatRecord:
    id: int
    title: str
    system_prompt: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    """Sampling parameters and ``max_tokens`` as plain JSON values."""
    model: str | None = None
    drafter: str | None = None
    created_at: float = 0.0
    updated_at: float = 0.0
    engine: dict[str, Any] | None = None
    """The model files the chat last used: ``{"target": path, "drafter": path | None,
    "draft_mode": str | None}`` (names alone cannot find a file given by path)."""


@dataclass
class MessageRecord:
    id: int
    chat_id: int
    role: str
    content: str
    stats: dict[str, Any] | None = None
    status: str = COMPLETE
    created_at: float = 0.0


def default_path() -> Path:
    return data_dir() / "chats.sqlite3"


class HistoryDamaged(TandemError):
    """The history file fails SQLite's integrity check or cannot be read as a database."""


def _json_dict(raw: Any) -> dict | None:
    """A stored JSON object, or ``None`` when the column is empty or damaged: a bad
    ``params`` or ``stats`` value costs that value, never the chat."""
    if not raw:
        return None
    try:
        value = json.loads(raw)
    except (TypeError, ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def is_busy(exc: sqlite3.Error) -> bool:
    """Another connection holds the lock (``SQLITE_BUSY`` and its extended codes): worth
    waiting for, unlike every other error."""
    return (getattr(exc, "sqlite_errorcode", 0) or 0) & 0xFF == sqlite3.SQLITE_BUSY


def pending_migrations(version: int, path: Path) -> range:
    """The steps of :data:`MIGRATIONS` a file at schema ``version`` still needs. A file
    from a newer Tandem is refused: this one cannot know what its schema means."""
    if version > SCHEMA_VERSION:
        raise TandemError(
            f"The chat history at {path} was written by a newer Tandem "
            f"(schema {version}, this one knows {SCHEMA_VERSION}): upgrade Tandem."
        )
    return range(version, SCHEMA_VERSION)


def _chat(row: sqlite3.Row) -> ChatRecord:
    return ChatRecord(
        id=row["id"], title=str(row["title"] or ""), system_prompt=str(row["system_prompt"] or ""),
        params=_json_dict(row["params"]) or {}, model=row["model"], drafter=row["drafter"],
        created_at=row["created_at"], updated_at=row["updated_at"],
        engine=_json_dict(row["engine"]),
    )


def _message(row: sqlite3.Row) -> MessageRecord:
    return MessageRecord(
        id=row["id"], chat_id=row["chat_id"], role=row["role"], content=str(row["content"] or ""),
        stats=_json_dict(row["stats"]), status=row["status"],
        created_at=row["created_at"],
    )


class History:
    """The chat store. Safe to share between the UI thread and one generation worker."""

    def __init__(self, path: Path | str | None = None) -> None:
        self.path = Path(path) if path is not None else default_path()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TandemError(f"Cannot create the folder for the chat history {self.path}: {exc.strerror}. "
                              "Set TANDEM_HOME to a writable folder or pass --history FILE.") from None
        self._lock = threading.RLock()
        try:
            self._db = sqlite3.connect(
                self.path, isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_S
            )
        except sqlite3.DatabaseError as exc:
            raise self._open_error(exc) from None
        try:
            self._db.row_factory = sqlite3.Row
            # structure only: rows that break a CHECK (an unknown role) are still readable
            damage = [r[0] for r in self._db.execute("PRAGMA quick_check").fetchall()
                      if r[0] != "ok" and not r[0].startswith(("CHECK constraint failed", "NULL value in"))]
            if damage:
                raise HistoryDamaged(f"The chat history at {self.path} is damaged ({damage[0].splitlines()[-1]}).")
            self._use_wal()
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._migrate()
            self._reindex_unfinished()
        except sqlite3.DatabaseError as exc:
            self._db.close()
            raise self._open_error(exc) from None
        except BaseException:  # damaged, from a newer Tandem, interrupted: no open handle left behind
            self._db.close()
            raise

    def _open_error(self, exc: sqlite3.DatabaseError) -> TandemError:
        """What to tell the user when the file cannot be opened (it is left alone)."""
        if "malformed" in str(exc):  # a file that is no database at all
            return HistoryDamaged(f"The chat history at {self.path} is damaged ({exc}).")
        return TandemError(f"The chat history at {self.path} cannot be opened: {exc}.")

    # -- plumbing -----------------------------------------------------------------
    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One atomic transaction (the connection is otherwise in autocommit mode)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _use_wal(self) -> None:
        """Put the file in WAL mode, trying again while another opener holds the lock.

        Why a loop and not the busy timeout: switching a new file to WAL needs it to
        itself, and when two openers ask at once SQLite fails one of them at once
        ("database is locked") rather than let both wait on each other. Once the
        other's switch is done, this one finds WAL already on and has nothing to do.
        """
        deadline = time.monotonic() + BUSY_TIMEOUT_S
        pause = 0.001
        while True:
            try:
                self._db.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as exc:
                if not is_busy(exc) or time.monotonic() >= deadline:
                    raise
            time.sleep(pause)
            pause = min(2 * pause, 0.05)

    def _schema_version(self) -> int:
        return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    def _migrate(self) -> None:
        """Bring the file up to :data:`SCHEMA_VERSION`, every missing step in one write
        transaction that also reads the version it starts from.

        Why the version is read again under the write lock: two Tandems opening a new
        file at once both read version 0 first, and the second would re-run the steps
        the first had just committed ("table chats already exists"). ``BEGIN IMMEDIATE``
        serializes the openers and shows each the file as the one before left it. A
        locked file waits out the busy timeout, then fails as any write would.
        """
        if not pending_migrations(self._schema_version(), self.path):
            return  # versions only go up, so an up-to-date read needs no lock to be sure
        with self._tx() as db:
            steps = pending_migrations(self._schema_version(), self.path)
            for step in steps:
                MIGRATIONS[step](db)
            if steps:
                db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def _reindex_unfinished(self) -> None:
        """Index replies whose writer died mid-stream: streamed fragments are indexed when
        a reply finishes, so a crash leaves its text out of search until this runs."""
        with self._tx() as db:
            db.execute("DELETE FROM messages_fts WHERE rowid IN (SELECT id FROM messages WHERE status = ?)",
                       (INTERRUPTED,))
            db.execute("INSERT INTO messages_fts(rowid, content) SELECT id, content FROM messages WHERE status = ?",
                       (INTERRUPTED,))

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> History:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- chats --------------------------------------------------------------------
    def create_chat(
        self, title: str = "New chat", *, system_prompt: str = "", params: dict | None = None,
        model: str | None = None, drafter: str | None = None,
    ) -> ChatRecord:
        now = time.time()
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO chats (title, system_prompt, params, model, drafter, created_at, updated_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (title, system_prompt, json.dumps(params or {}), model, drafter, now, now),
            )
            chat_id = int(cur.lastrowid or 0)
        return self.get_chat(chat_id)

    def get_chat(self, chat_id: int) -> ChatRecord:
        with self._lock:
            row = self._db.execute("SELECT * FROM chats WHERE id = ?", (chat_id,)).fetchone()
        if row is None:
            raise TandemError(f"No chat {chat_id} in the history.")
        return _chat(row)

    def list_chats(self) -> list[ChatRecord]:
        """Most recently used first."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM chats ORDER BY updated_at DESC, id DESC").fetchall()
        return [_chat(r) for r in rows]

    def update_chat(self, chat_id: int, **changes: Any) -> ChatRecord:
        """Change any of title, system_prompt, params, model, drafter, engine."""
        allowed = {"title", "system_prompt", "params", "model", "drafter", "engine"}
        unknown = set(changes) - allowed
        if unknown:
            raise ValueError(f"cannot update chat fields {sorted(unknown)}")
        if "params" in changes:
            changes["params"] = json.dumps(changes["params"] or {})
        if "engine" in changes:
            changes["engine"] = json.dumps(changes["engine"]) if changes["engine"] else None
        if changes:
            cols = ", ".join(f"{k} = ?" for k in changes)
            with self._tx() as db:
                db.execute(
                    f"UPDATE chats SET {cols}, updated_at = ? WHERE id = ?",
                    (*changes.values(), time.time(), chat_id),
                )
        return self.get_chat(chat_id)

    def delete_chat(self, chat_id: int) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM chats WHERE id = ?", (chat_id,))

    def _touch(self, db: sqlite3.Connection, chat_id: int) -> None:
        db.execute("UPDATE chats SET updated_at = ? WHERE id = ?", (time.time(), chat_id))

    # -- messages -----------------------------------------------------------------
    def messages(self, chat_id: int) -> list[MessageRecord]:
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM messages WHERE chat_id = ? ORDER BY id", (chat_id,)
            ).fetchall()
        return [_message(r) for r in rows]

    def get_message(self, message_id: int) -> MessageRecord:
        with self._lock:
            row = self._db.execute("SELECT * FROM messages WHERE id = ?", (message_id,)).fetchone()
        if row is None:
            raise TandemError(f"No message {message_id} in the history.")
        return _message(row)

    def add_message(
        self, chat_id: int, role: str, content: str, *, status: str = COMPLETE,
        stats: dict | None = None,
    ) -> MessageRecord:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {role!r}")
        if status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, not {status!r}")
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO messages (chat_id, role, content, stats, status, created_at)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (chat_id, role, content, json.dumps(stats) if stats else None, status, time.time()),
            )
            self._touch(db, chat_id)
            message_id = int(cur.lastrowid or 0)
        return self.get_message(message_id)

    def start_reply(self, chat_id: int) -> MessageRecord:
        """An empty assistant message, ``interrupted`` until :meth:`finish_reply` says otherwise."""
        return self.add_message(chat_id, "assistant", "", status=INTERRUPTED)

    def append(self, message_id: int, text: str) -> None:
        """Add streamed text to a message, committed at once (one small transaction)."""
        if not text:
            return
        with self._lock:
            self._db.execute(
                "UPDATE messages SET content = content || ? WHERE id = ?", (text, message_id)
            )

    def finish_reply(self, message_id: int, status: str, stats: dict | None = None) -> None:
        if status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, not {status!r}")
        with self._tx() as db:
            db.execute(
                "UPDATE messages SET status = ?, stats = ? WHERE id = ?",
                (status, json.dumps(stats) if stats else None, message_id),
            )

    def delete_from(self, chat_id: int, message_id: int) -> int:
        """Delete a message and every later one in its chat (regenerate, edit-and-resend)."""
        with self._tx() as db:
            cur = db.execute(
                "DELETE FROM messages WHERE chat_id = ? AND id >= ?", (chat_id, message_id)
            )
            self._touch(db, chat_id)
            return cur.rowcount

    # -- search -------------------------------------------------------------------
    def search(self, query: str, limit: int = 50) -> list[SearchHit]:
        """Messages of every chat that hold all the words of ``query`` (the last one as a
        prefix, so results follow typing), best match first."""
        with self._lock:
            return search_messages(self._db, query, limit)

    # -- export -------------------------------------------------------------------
    def export_markdown(self, chat_id: int) -> str:
        return chat_markdown(self.get_chat(chat_id), self.messages(chat_id))


def chat_markdown(chat: ChatRecord, messages: list[MessageRecord]) -> str:
    """A chat as a Markdown document: title, settings, then one section per message."""
    lines = [f"# {chat.title}", ""]
    if chat.model:
        lines.append(f"- Model: `{chat.model}`" + (f", drafter `{chat.drafter}`" if chat.drafter else ""))
    if chat.params:
        settings = ", ".join(f"{k}={v}" for k, v in chat.params.items() if v not in (None, []))
        lines.append(f"- Settings: {settings}")
    if chat.system_prompt:
        lines += ["", "## System", "", chat.system_prompt]
    for m in messages:
        heading = {"user": "User", "assistant": "Assistant", "system": "System"}[m.role]
        if m.status == INTERRUPTED:
            heading += " (interrupted)"
        lines += ["", f"## {heading}", "", m.content]
    return "\n".join(lines).rstrip() + "\n"
