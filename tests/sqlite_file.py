"""What a history file says about itself, read through a connection of its own: the
checks the tests make on the file on disk, not on what the store's open connection sees."""

from __future__ import annotations

import sqlite3
from pathlib import Path


def pragma(path: Path, name: str) -> str | int:
    """The value of ``PRAGMA name`` (``user_version``, ``journal_mode``, ...)."""
    db = sqlite3.connect(path)
    try:
        return db.execute(f"PRAGMA {name}").fetchone()[0]
    finally:
        db.close()


def integrity_ok(path: Path) -> bool:
    """SQLite's full consistency check of the file passes."""
    return pragma(path, "integrity_check") == "ok"
