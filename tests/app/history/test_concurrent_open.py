"""Several Tandems opening one history file at once (two `tandem chat`s started together
on a new data dir): each open succeeds, no migration runs twice, a lock is waited for.

The interleavings are forced, not hoped for: a trace callback on the opener's connection
lets the test step in just as it starts a given statement, and the processes of the
stress test are released together by the parent. Nothing here sleeps to line things up.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlite_file import integrity_ok, pragma

from tandem.app.history import database
from tandem.app.history.database import History, is_busy, pending_migrations
from tandem.app.history.schema import SCHEMA_VERSION
from tandem.errors import TandemError

WAIT_S = 60.0
"""A bound on waiting for a signal that should come at once: a hang fails, it never paces."""


def trace_next_connection(monkeypatch: pytest.MonkeyPatch, on_statement: Callable[[str], None]) -> None:
    """Make the next ``sqlite3.connect`` (the opener's) call ``on_statement`` with each
    statement as it starts, before it takes any lock: the hook to act between two of
    :class:`History`'s statements. Later connections are left alone."""
    real_connect = sqlite3.connect

    def connect(*args, **kwargs) -> sqlite3.Connection:
        monkeypatch.setattr(sqlite3, "connect", real_connect)
        db = real_connect(*args, **kwargs)
        db.set_trace_callback(on_statement)
        return db

    monkeypatch.setattr(sqlite3, "connect", connect)


def schema(path: Path) -> list[tuple[str, str]]:
    """Every table, index and trigger of the file with its SQL, to compare files by."""
    db = sqlite3.connect(path)
    try:
        return db.execute("SELECT name, sql FROM sqlite_master ORDER BY name").fetchall()
    finally:
        db.close()


def holding_write_lock(path: Path, *, wal: bool) -> sqlite3.Connection:
    """Another connection in the middle of a write to a version-0 file (``COMMIT`` it to let go)."""
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    if wal:
        db.execute("PRAGMA journal_mode=WAL")
    db.execute("BEGIN IMMEDIATE")
    db.execute("CREATE TABLE other_writer (x)")
    return db


def open_in_thread(path: Path, ended: threading.Event) -> tuple[threading.Thread, list[BaseException]]:
    """Open ``path`` in a thread that sets ``ended`` when the open is over, either way."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            History(path).close()
        except BaseException as exc:  # noqa: BLE001 - handed to the test to assert on
            errors.append(exc)
        finally:
            ended.set()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, errors


# -- the pure helpers ------------------------------------------------------------------
def test_pending_migrations_counts_from_the_version_and_refuses_a_newer_file(tmp_path: Path) -> None:
    assert list(pending_migrations(0, tmp_path)) == list(range(SCHEMA_VERSION))
    assert not pending_migrations(SCHEMA_VERSION, tmp_path)
    with pytest.raises(TandemError, match="newer Tandem"):
        pending_migrations(SCHEMA_VERSION + 1, tmp_path)


def test_is_busy_knows_a_lock_from_other_errors(tmp_path: Path) -> None:
    path = tmp_path / "chats.sqlite3"
    holder = holding_write_lock(path, wal=False)
    other = sqlite3.connect(path, isolation_level=None, timeout=0)
    with pytest.raises(sqlite3.OperationalError) as locked:
        other.execute("BEGIN IMMEDIATE")
    with pytest.raises(sqlite3.OperationalError) as wrong:
        other.execute("SELECT * FROM no_such_table")
    holder.execute("ROLLBACK")
    assert is_busy(locked.value) and not is_busy(wrong.value)


# -- the races -------------------------------------------------------------------------
def test_a_file_another_opener_migrated_meanwhile_is_not_migrated_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The reported failure, forced: this opener has read version 0 when another Tandem
    migrates the new file; it used to re-run migration 0 ("table chats already exists")."""
    path = tmp_path / "chats.sqlite3"
    other_open: list[BaseException | None] = []

    def another_tandem_opens_first(sql: str) -> None:
        if sql.startswith("BEGIN") and not other_open:  # this opener's first write
            try:
                History(path).close()
                other_open.append(None)
            except BaseException as exc:  # noqa: BLE001 - trace callbacks swallow exceptions
                other_open.append(exc)

    trace_next_connection(monkeypatch, another_tandem_opens_first)
    with History(path) as history:
        assert history.create_chat("after the race").id == 1
    assert other_open == [None]
    assert pragma(path, "user_version") == SCHEMA_VERSION and integrity_ok(path)


def test_switching_a_new_file_to_wal_waits_for_another_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SQLite fails the switch to WAL at once, without its busy timeout, while another
    connection holds the write lock (as a second opener of a new file does): the opener
    tries again rather than fail with "database is locked"."""
    path = tmp_path / "chats.sqlite3"
    holder = holding_write_lock(path, wal=False)
    attempts: list[str] = []
    retried_or_ended = threading.Event()

    def count_wal_switches(sql: str) -> None:
        if sql.startswith("PRAGMA journal_mode"):
            attempts.append(sql)
            if len(attempts) == 2:
                retried_or_ended.set()

    trace_next_connection(monkeypatch, count_wal_switches)
    thread, errors = open_in_thread(path, retried_or_ended)
    assert retried_or_ended.wait(WAIT_S)
    holder.execute("COMMIT")  # only once the first switch has failed
    thread.join(WAIT_S)
    assert errors == [] and len(attempts) >= 2
    assert pragma(path, "journal_mode") == "wal" and pragma(path, "user_version") == SCHEMA_VERSION


def test_a_migration_waits_for_another_writer_to_finish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The busy timeout still covers the migration: it starts while another connection
    writes, and runs once that one commits."""
    path = tmp_path / "chats.sqlite3"
    holder = holding_write_lock(path, wal=True)
    migrating, ended = threading.Event(), threading.Event()

    def on_statement(sql: str) -> None:
        if sql.startswith("BEGIN IMMEDIATE"):
            migrating.set()

    trace_next_connection(monkeypatch, on_statement)
    thread, errors = open_in_thread(path, ended)
    assert migrating.wait(WAIT_S) and not ended.is_set()
    holder.execute("COMMIT")
    thread.join(WAIT_S)
    assert errors == []
    assert pragma(path, "user_version") == SCHEMA_VERSION
    assert ("other_writer", "CREATE TABLE other_writer (x)") in schema(path)  # the other's write kept


def test_a_file_locked_past_the_busy_timeout_is_a_clear_error_and_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = tmp_path / "chats.sqlite3"
    holder = holding_write_lock(path, wal=True)
    monkeypatch.setattr(database, "BUSY_TIMEOUT_S", 0.05)
    with pytest.raises(TandemError, match="cannot be opened: database is locked"):
        History(path)
    holder.execute("COMMIT")
    assert pragma(path, "user_version") == 0  # nothing half-done: the next open migrates it
    History(path).close()
    assert pragma(path, "user_version") == SCHEMA_VERSION


STRESS_CHILD = r"""
import sys
from tandem.app.history.database import History

print("ready", flush=True)
for line in sys.stdin:  # one new file per round, sent to every child at once
    try:
        with History(line.strip()) as history:
            history.create_chat("mine")
        print("ok", flush=True)
    except BaseException as exc:
        print(f"{type(exc).__name__}: {exc}".replace("\n", " "), flush=True)
"""


def test_four_processes_opening_a_new_file_at_once_all_succeed(tmp_path: Path) -> None:
    """Four real processes, released together on each of many new files (the old code
    failed most rounds): every open succeeds and the file ends up whole."""
    rounds, openers = 25, 4
    children = [
        subprocess.Popen([sys.executable, "-c", STRESS_CHILD], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
        for _ in range(openers)
    ]
    try:
        assert [c.stdout.readline().strip() for c in children] == ["ready"] * openers
        for n in range(rounds):
            path = tmp_path / f"round{n}" / "chats.sqlite3"
            for c in children:  # every child waits on its stdin: this is the barrier
                c.stdin.write(f"{path}\n")
                c.stdin.flush()
            said = [c.stdout.readline().strip() for c in children]
            assert said == ["ok"] * openers, f"round {n}: {said}"
            assert pragma(path, "user_version") == SCHEMA_VERSION and integrity_ok(path)
            db = sqlite3.connect(path)
            assert db.execute("SELECT count(*) FROM chats").fetchone()[0] == openers
            db.close()
    finally:
        for c in children:
            c.stdin.close()
            c.wait(WAIT_S)
    single = tmp_path / "alone.sqlite3"
    History(single).close()
    assert schema(tmp_path / "round0" / "chats.sqlite3") == schema(single)
