"""`tandem chats`: the chat app's saved chats from the command line, for scripts and grep.

``tandem chats`` (or ``tandem chats list``) lists them (newest first), ``tandem chats
show ID`` prints one as Markdown (the chat app's export), ``tandem chats search WORDS``
finds the messages that hold every word; ``--json`` gives each as JSON instead. Titles
and messages are the model's and anybody's text: printed, they lose their escape
sequences and control characters (JSON, ASCII-only, escapes them), so nothing in a chat
can drive the terminal. A search hit's matched words are ``[bracketed]`` on screen; in
JSON its snippet is plain text and ``highlights`` gives their offsets in it.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

from tandem.app.history.database import History, default_path
from tandem.app.history.full_text import HIT_END, HIT_START, SearchHit, unmark
from tandem.app.terminal_text import strip_controls
from tandem.errors import TandemError


def _options(p: argparse.ArgumentParser, *, after_action: bool = False) -> None:
    """``--history`` and ``--json``, taken before or after the action (the action's own
    copies default to "not given", so they never undo what was given before it)."""
    unset = {"default": argparse.SUPPRESS} if after_action else {}
    p.add_argument("--history", metavar="FILE", help="chat database (default: chats.sqlite3 in the Tandem data dir)",
                   **unset)
    p.add_argument("--json", action="store_true", help="JSON instead of text", **unset)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chats", help="list, show and search the chat app's saved chats")
    _options(p)
    what = p.add_subparsers(dest="what", metavar="ACTION")
    listing = what.add_parser("list", help="the saved chats, most recently used first (the default)")
    show = what.add_parser("show", help="one chat as Markdown")
    show.add_argument("chat_id", type=int, metavar="ID")
    search = what.add_parser("search", help="messages holding every word (the last one as a prefix)")
    search.add_argument("words", nargs="+")
    search.add_argument("-n", "--limit", type=int, default=20)
    for action in (listing, show, search):
        _options(action, after_action=True)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    path = Path(args.history) if args.history else default_path()
    if not path.exists():  # nothing saved yet: say so, and create nothing
        if args.what == "show":
            raise TandemError(f"No chat {args.chat_id}: there is no chat history at {path} yet.")
        print("[]" if args.json else f"No saved chats in {path}.")
        return 0 if args.what != "search" else 1
    with History(path) as history:
        if args.what == "show":
            return _show(history, args.chat_id, args.json)
        if args.what == "search":
            return _search(history, " ".join(args.words), args.limit, args.json)
        return _list(history, args.json)


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def _list(history: History, as_json: bool) -> int:
    chats = history.list_chats()
    if as_json:
        print(json.dumps([asdict(c) for c in chats], indent=2))
        return 0
    if not chats:
        print(f"No saved chats in {history.path}.")
    for c in chats:
        model = f"  [{strip_controls(c.model)}]" if c.model else ""
        print(f"{c.id:>5}  {_when(c.updated_at)}  {strip_controls(c.title)}{model}")
    return 0


def _show(history: History, chat_id: int, as_json: bool) -> int:
    if as_json:
        chat = history.get_chat(chat_id)
        messages = [asdict(m) for m in history.messages(chat_id)]
        print(json.dumps({**asdict(chat), "messages": messages}, indent=2))
    else:
        print(strip_controls(history.export_markdown(chat_id)), end="")
    return 0


def hit_json(hit: SearchHit) -> dict:
    """A search hit for ``--json``: the snippet as plain text and the matched words as
    ``highlights``, ``[start, end)`` character offsets into it, rather than the raw
    control-character marks that only the screen's highlighting understands."""
    snippet, spans = unmark(hit.snippet)
    return {**asdict(hit), "snippet": snippet, "highlights": [list(span) for span in spans]}


def _search(history: History, query: str, limit: int, as_json: bool) -> int:
    hits = history.search(query, limit=max(1, limit))
    if as_json:
        print(json.dumps([hit_json(h) for h in hits], indent=2))
        return 0
    for h in hits:
        snippet = strip_controls(h.snippet.replace(HIT_START, "[").replace(HIT_END, "]")).replace("\n", " ")
        print(f"{h.chat_id:>5}  {strip_controls(h.chat_title)}  ({h.role}): {snippet}")
    if not hits:
        print(f"No message holds {query!r}.")
    return 0 if hits else 1
