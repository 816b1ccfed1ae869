"""`tandem chat` in a real 80x24 terminal (tmux): footer, dialog buttons and labels on
screen, and the draft-cycling keys that reach the app through tmux."""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

from tui_pilot import wait_for


def start_chat(tmux, home: Path, model: Path, *extra: str) -> None:  # noqa: F811
    env = f"TANDEM_HOME={shlex.quote(str(home))} HF_HUB_OFFLINE=1 TERM=xterm-256color"
    command = (f"env {env} {shlex.quote(sys.executable)} -m tandem.app.cli chat -m {shlex.quote(str(model))} "
               f"--temp 0 --threads 1 {' '.join(extra)}; echo TANDEM-EXITED $?; sleep 30")
    tmux("new-session", "-d", "-s", "chat", "-x", "80", "-y", "24", command)


def wait_gone(tmux, text: str, timeout: float = 30.0) -> str:  # noqa: F811
    """Wait until ``text`` has left the pane (a dialog closed): a key sent right after Esc
    would reach the app as Alt+key."""
    deadline = time.monotonic() + timeout
    while True:
        pane = tmux("capture-pane", "-p", "-t", "chat")
        if text not in pane:
            return pane
        assert time.monotonic() < deadline, f"{text!r} never went away; the pane shows:\n{pane}"
        time.sleep(0.2)


def quit_chat(tmux) -> None:  # noqa: F811
    tmux("send-keys", "-t", "chat", "C-q")
    pane = wait_for(tmux, "TANDEM-EXITED")
    assert "TANDEM-EXITED 0" in pane and "Traceback" not in pane


def test_footer_dialogs_and_labels_fit_80x24(tmux, stories260k: Path, isolated_home: Path) -> None:  # noqa: F811
    start_chat(tmux, isolated_home, stories260k, "-n", "12")
    pane = wait_for(tmux, "Model stories260K")
    footer = pane.rstrip("\n").splitlines()[-1]
    for key in ("esc Stop", "^n New", "^r Redo", "^e Edit", "^o Set", "^t Model", "^f Find", "f5 Copy",
                "f1 Help", "^q Quit"):
        assert key in footer, footer
    tmux("send-keys", "-t", "chat", "-l", "Once upon a time")
    tmux("send-keys", "-t", "chat", "Enter")
    pane = wait_for(tmux, "12 tokens")
    assert "Assistant · stories260K" in pane
    assert "\x1b" not in pane and "^[" not in pane  # no stray control text
    tmux("send-keys", "-t", "chat", "C-o")
    pane = wait_for(tmux, "Save (ctrl+s)")  # the buttons: drawn last, and on screen
    assert "Chat settings" in pane and "Cancel" in pane
    tmux("send-keys", "-t", "chat", "Escape")
    wait_gone(tmux, "Chat settings")
    tmux("send-keys", "-t", "chat", "C-t")
    pane = wait_for(tmux, "Apply (ctrl+s)")
    pane = wait_for(tmux, "Cancel")
    assert pane.count("stories260K") >= 2  # the model given by path is listed (and in the status line)
    tmux("send-keys", "-t", "chat", "Escape")
    wait_gone(tmux, "Apply (ctrl+s)")
    quit_chat(tmux)


def test_ctrl_bracket_and_function_keys_cycle_drafts_under_tmux(tmux, stories260k: Path,  # noqa: F811
                                                                isolated_home: Path) -> None:
    start_chat(tmux, isolated_home, stories260k)
    wait_for(tmux, "Model stories260K")
    tmux("send-keys", "-t", "chat", "F9")
    wait_for(tmux, "Autocomplete")
    tmux("send-keys", "-t", "chat", "-l", "Once upon a time")
    pane = wait_for(tmux, "drafts in", timeout=120)
    assert "▶ 1." in pane and "2." in pane
    tmux("send-keys", "-t", "chat", "C-]")
    pane = wait_for(tmux, "▶ 2.")
    tmux("send-keys", "-t", "chat", "F8")
    wait_for(tmux, "▶ 3.")
    tmux("send-keys", "-t", "chat", "F7")
    pane = wait_for(tmux, "▶ 2.")
    assert "Once upon a time]" not in pane  # no literal bracket typed into the editor
    tmux("send-keys", "-t", "chat", "Escape")
    wait_gone(tmux, "drafts in")
    quit_chat(tmux)


def test_multi_turn_chat_on_a_real_model_at_80x24(tmux, real_models, isolated_home: Path) -> None:  # noqa: F811
    """Three turns with the real SmolLM2 chat model: every reply stored complete, its label
    and stats on screen, the footer whole, no escape sequences printed as text."""
    from tandem.app.history.database import COMPLETE, History
    from tandem.models.paths import data_dir

    start_chat(tmux, isolated_home, real_models.smollm2, "-n", "8")
    wait_for(tmux, "Model smollm2", timeout=120)
    for turn, question in enumerate(["Hi!", "Name a colour.", "Thanks."], 1):
        tmux("send-keys", "-t", "chat", "-l", question)
        tmux("send-keys", "-t", "chat", "Enter")
        deadline = time.monotonic() + 120
        while True:  # until this turn's reply is stored
            with History(data_dir() / "chats.sqlite3") as h:
                chats = h.list_chats()
                replies = [m for m in h.messages(chats[0].id) if m.role == "assistant"] if chats else []
            if len(replies) == turn and replies[-1].status == COMPLETE:
                break
            assert time.monotonic() < deadline, tmux("capture-pane", "-p", "-t", "chat")
            time.sleep(0.2)
        pane = wait_gone(tmux, "streaming")
        assert "Assistant · smollm2" in pane and "tokens" in pane
        footer = pane.rstrip("\n").splitlines()[-1]
        assert "^f Find" in footer and "f1 Help" in footer and "^q Quit" in footer, footer
        assert "\x1b" not in pane and "^[" not in pane and "[0m" not in pane
    quit_chat(tmux)
