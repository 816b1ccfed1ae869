"""`tandem chat` for real, in a terminal: tmux runs it, we send keys and read the pane."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from tui_pilot import wait_for

from tandem.app.history.database import COMPLETE, History
from tandem.models.paths import data_dir

IN_CI = os.environ.get("CI", "").lower() == "true"






def expected_reply(model: Path, max_tokens: int) -> str:
    from tandem.kernels.sampling_params import SamplingParams
    from tandem.runtime.backends.llama import LlamaCppBackend
    from tandem.runtime.backends.llama_config import LlamaConfig
    from tandem.runtime.chat import ChatEngine

    with LlamaCppBackend(model, LlamaConfig(n_ctx=2048, n_threads=1)) as target:
        events = list(ChatEngine(target).stream([{"role": "user", "content": "Once upon a time"}],
                                                SamplingParams(temperature=0.0), max_tokens))
    return events[-1].text


def test_chat_in_a_real_terminal(tmux, stories260k: Path, isolated_home: Path) -> None:
    env = f"TANDEM_HOME={shlex.quote(str(isolated_home))} HF_HUB_OFFLINE=1 TERM=xterm-256color"
    command = (f"env {env} {shlex.quote(sys.executable)} -m tandem.app.cli chat "
               f"-m {shlex.quote(str(stories260k))} --temp 0 -n 24 --threads 1; "
               "echo TANDEM-EXITED $?; sleep 30")
    tmux("new-session", "-d", "-s", "chat", "-x", "110", "-y", "30", command)
    wait_for(tmux, "Model stories260K")  # the model is loaded
    tmux("send-keys", "-t", "chat", "-l", "Once upon a time")
    tmux("send-keys", "-t", "chat", "Enter")
    pane = wait_for(tmux, "24 tokens")
    reply = expected_reply(stories260k, 24)
    first_words = " ".join(reply.split()[:4])
    assert first_words in pane, pane
    assert "TTFT" in pane and "tok/s" in pane and "KV" in pane
    tmux("send-keys", "-t", "chat", "F1")
    wait_for(tmux, "Tandem chat: keys")
    tmux("send-keys", "-t", "chat", "Escape")
    tmux("send-keys", "-t", "chat", "C-q")
    pane = wait_for(tmux, "TANDEM-EXITED")
    assert "TANDEM-EXITED 0" in pane and "Traceback" not in pane
    with History(data_dir() / "chats.sqlite3") as history:
        (chat,) = history.list_chats()
        user, answer = history.messages(chat.id)
        assert (user.content, answer.content, answer.status) == ("Once upon a time", reply, COMPLETE)


def test_first_run_screen_in_a_real_terminal(tmux, isolated_home: Path) -> None:
    env = f"TANDEM_HOME={shlex.quote(str(isolated_home))} HF_HUB_OFFLINE=1 TERM=xterm-256color"
    command = f"env {env} {shlex.quote(sys.executable)} -m tandem.app.cli chat; echo TANDEM-EXITED $?; sleep 30"
    tmux("new-session", "-d", "-s", "chat", "-x", "100", "-y", "30", command)
    wait_for(tmux, "No model yet")
    tmux("send-keys", "-t", "chat", "q")
    pane = wait_for(tmux, "TANDEM-EXITED")
    assert "TANDEM-EXITED 0" in pane and "Traceback" not in pane
