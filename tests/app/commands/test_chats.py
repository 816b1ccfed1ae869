"""`tandem chats`: `list` is an action of its own (the help says "list, show and search"),
and `--json search` gives plain text with match offsets, never the control characters
that mark the matches for the screen."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.app.cli import main
from tandem.app.commands.chats import hit_json
from tandem.app.history.database import History, default_path
from tandem.app.history.full_text import HIT_END, HIT_START, SearchHit, unmark

S, E = HIT_START, HIT_END


def tandem(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """Exit status and standard output of ``tandem ARGS``, run in this process."""
    code = main(list(args))
    return code, capsys.readouterr().out


@pytest.fixture()
def saved(isolated_home: Path) -> Path:
    """A history with two chats, one of them holding "Banana" twice."""
    with History() as history:
        fruit = history.create_chat("Fruit")
        history.add_message(fruit.id, "user", "I like Banana bread and banana splits.")
        history.create_chat("Rivers \x1b]52;c;aGk=\x07of Europe")
    return default_path()


# -- `list` ----------------------------------------------------------------------------
def test_list_is_what_bare_chats_prints(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bare = tandem(capsys, "chats")
    assert bare[0] == 0 and "Fruit" in bare[1] and "Rivers" in bare[1] and "\x1b" not in bare[1]
    assert tandem(capsys, "chats", "list") == bare
    assert tandem(capsys, "chats", "list", "--history", str(saved)) == bare
    as_json = tandem(capsys, "chats", "--json")
    assert [c["title"] for c in json.loads(as_json[1])] == ["Rivers \x1b]52;c;aGk=\x07of Europe", "Fruit"]
    assert tandem(capsys, "chats", "list", "--json") == as_json
    assert tandem(capsys, "chats", "--json", "list") == as_json


def test_list_of_no_history_creates_nothing(isolated_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = tandem(capsys, "chats", "list")
    assert code == 0 and "No saved chats" in out
    assert tandem(capsys, "chats", "list", "--json") == (0, "[]\n")
    assert not default_path().exists()


def test_chats_list_from_the_command_line(saved: Path) -> None:
    """The report: a real `tandem chats list` exited 2 with "invalid choice: 'list'"."""
    r = subprocess.run([sys.executable, "-m", "tandem.app.cli", "chats", "list"],
                       capture_output=True, text=True, timeout=180, env=dict(os.environ))
    assert r.returncode == 0 and "Fruit" in r.stdout and r.stderr == ""
    helped = subprocess.run([sys.executable, "-m", "tandem.app.cli", "chats", "--help"],
                            capture_output=True, text=True, timeout=180, env=dict(os.environ))
    assert "list" in helped.stdout and "show" in helped.stdout and "search" in helped.stdout


# -- search: screen and JSON -----------------------------------------------------------
def test_json_search_is_plain_text_with_match_offsets(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = tandem(capsys, "chats", "--json", "search", "banana")
    assert code == 0
    assert "\\u0002" not in out and "\\u0003" not in out and S not in out and E not in out
    [hit] = json.loads(out)
    assert hit["chat_title"] == "Fruit" and hit["snippet"] == "I like Banana bread and banana splits."
    assert [hit["snippet"][a:b] for a, b in hit["highlights"]] == ["Banana", "banana"]
    assert tandem(capsys, "chats", "search", "banana", "--json") == (code, out)


def test_screen_search_keeps_its_highlighting(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = tandem(capsys, "chats", "search", "banana")
    assert code == 0 and "I like [Banana] bread and [banana] splits." in out
    assert S not in out and E not in out


@pytest.mark.parametrize(("marked", "plain", "spans"), [
    (f"I like {S}Banana{E} bread", "I like Banana bread", [(7, 13)]),
    (f"{S}a{E} b {S}cd{E}", "a b cd", [(0, 1), (4, 6)]),
    ("no match marked", "no match marked", []),
    (f"…{S}naïve{E} 🍌 {S}café{E}…", "…naïve 🍌 café…", [(1, 6), (9, 13)]),  # characters, not bytes
    (f"{S}{E}empty {S}open", "empty open", [(6, 10)]),  # never from FTS5: no empty span, an open one ends
    (f"stray{E} end", "stray end", []),
])
def test_unmark(marked: str, plain: str, spans: list[tuple[int, int]]) -> None:
    assert unmark(marked) == (plain, spans)
    text, found = unmark(marked)
    assert all(S not in text[a:b] and E not in text[a:b] for a, b in found)


def test_hit_json_keeps_every_other_field() -> None:
    hit = SearchHit(3, 9, "Fruit", "user", f"a {S}pear{E}", 12.5)
    assert hit_json(hit) == {"chat_id": 3, "message_id": 9, "chat_title": "Fruit", "role": "user",
                             "snippet": "a pear", "created_at": 12.5, "highlights": [[2, 6]]}
