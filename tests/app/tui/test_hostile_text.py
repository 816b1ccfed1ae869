"""A hostile history (titles, messages, system prompt, model names holding OSC 52, a
screen clear, a window title, C1 controls and Textual markup) walked through every
screen and dialog of the chat app: what is drawn holds no control character and shows
the markup as literal text, never as styles or click actions."""

from __future__ import annotations

import io
import re
import shutil
from pathlib import Path

import pytest
from rich.console import Console
from tui_pilot import SIZE, make_app, ready, until

from tandem.app.history.database import History

ESCAPES = ("\x1b]52;c;ZXZpbA==\x07"  # clipboard write
           "\x1b[2J\x1b[H"  # clear the screen
           "\x1b]0;pwned\x07"  # window title
           "\x9b2J\x9d0;c1\x9c\x85")  # C1: CSI, OSC ... ST, NEL
MARKUP = "[bold]B[/bold][@click=app.quit]Q[/]"
TITLE = f"T{ESCAPES}{MARKUP}"
pytestmark = pytest.mark.anyio
CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")


@pytest.fixture()
def anyio_backend() -> str:
    return "asyncio"


def drawn(app) -> str:
    """The text of the screen as the compositor draws it (toasts and dialogs included)."""
    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), force_terminal=True, color_system="truecolor",
                      record=True, legacy_windows=False, safe_box=False)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text(styles=False)


def check(app, where: str) -> str:
    text = drawn(app)
    bad = sorted({f"{ord(c):#x}" for c in CONTROL.findall(text)})
    assert not bad, f"{where}: control characters {bad} drawn:\n{text}"
    assert "ZXZpbA==" not in text and "pwned" not in text, f"{where}: an escape sequence's text leaked:\n{text}"
    return text


def hostile_history(path: Path, model_name: str) -> None:
    with History(path) as h:
        other = h.create_chat(f"Other {ESCAPES}{MARKUP}")
        h.add_message(other.id, "user", f"zebra {ESCAPES}{MARKUP}")
        chat = h.create_chat(TITLE, system_prompt=f"Be {ESCAPES}{MARKUP} brief.")
        h.add_message(chat.id, "user", f"zebra question {ESCAPES}{MARKUP}")
        h.add_message(chat.id, "assistant", f"zebra answer {ESCAPES}{MARKUP}\n\n```\ncode {ESCAPES}\n```",
                      stats={"generated_tokens": 3, "model": f"m{ESCAPES}{MARKUP}",
                             "drafter": f"d{ESCAPES}{MARKUP}"})
        h.update_chat(chat.id, engine={"target": f"/gone/{model_name}", "drafter": None, "draft_mode": None})


async def test_every_screen_and_dialog_with_a_hostile_history(stories260k: Path, tmp_path: Path) -> None:
    from tandem.models.paths import models_dir

    name = f"evil{ESCAPES}[bold]B[@click=app.quit]Q"  # no "/" in a file name
    models_dir().mkdir(parents=True, exist_ok=True)
    shutil.copyfile(stories260k, models_dir() / f"{name}.gguf")  # a model whose file name is hostile
    history = tmp_path / "h.sqlite3"
    hostile_history(history, f"{name}.gguf")
    app = make_app(stories260k, tmp_path, history_path=history)
    async with app.run_test(size=SIZE, notifications=True) as pilot:  # toasts drawn too
        screen = await ready(app, pilot)
        assert screen.chat is not None and screen.chat.title == TITLE
        text = check(app, "chat screen")
        assert "[bold]B[/bold][@click=app.quit]Q[/]" in text  # the header's title, literally
        steps = [("ctrl+o", "settings"), ("ctrl+t", "models"), ("f1", "help"), ("f2", "rename"),
                 ("ctrl+s", "export"), ("f8", "delete")]
        for key, where in steps:
            await pilot.press(key)
            await until(pilot, lambda: app.screen is not screen)
            await pilot.pause()
            check(app, where)
            await pilot.press("escape")
            await until(pilot, lambda: app.screen is screen)
        await pilot.press("ctrl+f")
        await until(pilot, lambda: app.screen is not screen)
        await pilot.press(*"zebra")
        results = app.screen.query_one("#search-results")
        await until(pilot, lambda: results.option_count >= 2)
        check(app, "search")
        await pilot.press("escape")
        await until(pilot, lambda: app.screen is screen)
        # notifications quoting the title: a rename to a hostile title, then a delete
        await pilot.press("f2")
        await until(pilot, lambda: app.screen is not screen)
        app.screen.query_one("Input").value = f"R{ESCAPES}{MARKUP}"
        await pilot.press("enter")
        await until(pilot, lambda: app.screen is screen)
        check(app, "renamed")
        await pilot.press("f8", "y")
        await until(pilot, lambda: app.screen is screen and "Deleted" in drawn(app))  # its notification
        check(app, "deleted")
        # the other chat, its reply's stats and the model picker listing the hostile file
        await pilot.press("ctrl+t")
        await until(pilot, lambda: app.screen is not screen)
        text = check(app, "models with a hostile file")
        assert "evil" in text
        await pilot.press("escape")
        await until(pilot, lambda: app.screen is screen)
        await pilot.press("f9")
        await until(pilot, lambda: app.screen is not screen)
        await pilot.pause()
        check(app, "autocomplete")
