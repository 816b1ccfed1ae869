"""Full-text search over every chat's messages (SQLite FTS5, schema v2/v3).

The index is kept by triggers (:mod:`tandem.app.history.schema`); this module turns
what a user types into an FTS5 query and reads ranked hits with a highlighted snippet.
"""

from __future__ import annotations

import re
import sqlite3
from dataclasses import dataclass

HIT_START, HIT_END = "\x02", "\x03"
"""Marks around the matched words in :attr:`SearchHit.snippet` (never in chat text)."""


@dataclass
class SearchHit:
    chat_id: int
    message_id: int
    chat_title: str
    role: str
    snippet: str
    """The text around the match, matched words between :data:`HIT_START` and :data:`HIT_END`."""
    created_at: float


def unmark(snippet: str) -> tuple[str, list[tuple[int, int]]]:
    """A snippet as plain text, and where its matched words lie in it: ``(start, end)``
    offsets in characters, end excluded.

    Why: :data:`HIT_START` and :data:`HIT_END` are control characters, fine for a screen
    that turns them into highlighting but noise to a script, which wants text it can
    print or compare as is and offsets to highlight with however it likes (inserted
    ``**`` could not be told apart from the Markdown that chat text is full of).
    """
    plain: list[str] = []
    spans: list[tuple[int, int]] = []
    at, start = 0, None
    for piece in re.split(f"([{HIT_START}{HIT_END}])", snippet):
        if piece == HIT_START:
            start = at if start is None else start
        elif piece == HIT_END:
            if start is not None and at > start:
                spans.append((start, at))
            start = None
        else:
            plain.append(piece)
            at += len(piece)
    if start is not None and at > start:  # never from FTS5, but a mark left open still ends
        spans.append((start, at))
    return "".join(plain), spans


def fts_query(text: str) -> str:
    """An FTS5 query for what a user typed: every word must occur, the last one as a
    prefix. Words are quoted, so FTS5 syntax (``AND``, ``"``, ``*``, ``:``) in the text
    is searched for literally rather than failing as a malformed query."""
    words = re.findall(r"\w+", text)
    if not words:
        return ""
    quoted = [f'"{w}"' for w in words]
    if not text[-1:].isspace():
        quoted[-1] += "*"
    return " ".join(quoted)


def search_messages(db: sqlite3.Connection, query: str, limit: int = 50) -> list[SearchHit]:
    """The search itself (:meth:`History.search` holds the connection's lock around it)."""
    match = fts_query(query)
    if not match:
        return []
    # rank and cut inside the index first, then join only the hits kept
    rows = db.execute(
        "SELECT m.id, m.chat_id, m.role, m.created_at, c.title, f.snippet FROM"
        f" (SELECT rowid, rank, snippet(messages_fts, 0, '{HIT_START}', '{HIT_END}', '…', 12) AS snippet"
        "  FROM messages_fts WHERE messages_fts MATCH ? ORDER BY rank LIMIT ?) f"
        " JOIN messages m ON m.id = f.rowid JOIN chats c ON c.id = m.chat_id"
        " ORDER BY f.rank, m.id DESC",
        (match, limit),
    ).fetchall()
    return [SearchHit(r["chat_id"], r["id"], r["title"], r["role"], r["snippet"], r["created_at"]) for r in rows]
