"""kill -9 a real process mid-reply: the database stays intact and keeps the partial reply."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlite_file import integrity_ok

from tandem.app.history.database import COMPLETE, INTERRUPTED, History

CHILD = r"""
import sys, time
from pathlib import Path
from tandem.app.history.database import History
from tandem.app.tui.model_choice import ModelChoice, load_engine
from tandem.runtime.engine.spec import EngineSpec
from tandem.app.tui.session import ChatSettings, run_reply
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.generate import TokenEvent

model, db, delay, max_tokens = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
engine = load_engine(ModelChoice(EngineSpec(Path(model), threads=1)))


class Paced:
    # the app's own engine, paced so the parent can kill it mid-stream
    def __getattr__(self, name):
        return getattr(engine, name)

    def stream(self, *args, **kwargs):
        for event in engine.stream(*args, **kwargs):
            if isinstance(event, TokenEvent) and delay:
                time.sleep(delay)
            yield event


history = History(db)
chat = history.create_chat("durable", params=ChatSettings(SamplingParams(temperature=0.0), max_tokens).to_dict())
history.add_message(chat.id, "user", "Once upon a time")
run_reply(Paced(), history, history.get_chat(chat.id), model_name="stories260K")
print("finished", flush=True)
"""


def reply_so_far(db: Path) -> str:
    """What another reader sees of the reply right now (read-only connection)."""
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        row = con.execute("SELECT content FROM messages WHERE role = 'assistant'").fetchone()
        con.close()
    except sqlite3.OperationalError:
        return ""
    return row[0] if row else ""


def full_reply(model: Path, max_tokens: int) -> str:
    from tandem.kernels.sampling_params import SamplingParams
    from tandem.runtime.backends.llama import LlamaCppBackend
    from tandem.runtime.backends.llama_config import LlamaConfig
    from tandem.runtime.chat import ChatEngine

    with LlamaCppBackend(model, LlamaConfig(n_ctx=2048, n_threads=1)) as target:
        events = list(ChatEngine(target).stream([{"role": "user", "content": "Once upon a time"}],
                                                SamplingParams(temperature=0.0), max_tokens))
    return events[-1].text


@pytest.mark.parametrize(("delay", "seen_chars"), [(0.01, 40), (0.0, 1)], ids=["paced", "full-speed"])
def test_kill_9_mid_stream_keeps_the_partial_reply(stories260k: Path, tmp_path: Path,
                                                   delay: float, seen_chars: int) -> None:
    db = tmp_path / "chats.sqlite3"
    max_tokens = 400 if delay else 1500
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(stories260k), str(db), str(delay),
                              str(max_tokens)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        seen = ""
        while len(seen) < seen_chars and child.poll() is None:
            assert time.monotonic() < deadline, "the child never started streaming"
            seen = reply_so_far(db)
            time.sleep(0.005)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode in (-signal.SIGKILL, 0), child.stderr.read().decode()[-2000:]

    with History(db) as history:
        assert integrity_ok(db)
        (chat,) = history.list_chats()
        assert chat.title == "durable"
        user, reply = history.messages(chat.id)
        assert (user.role, user.content, user.status) == ("user", "Once upon a time", COMPLETE)
        full = full_reply(stories260k, max_tokens)
        assert full.startswith(reply.content)  # exactly what was generated, nothing garbled
        assert len(reply.content) >= len(seen)  # everything a reader saw before the kill
        if child.returncode == -signal.SIGKILL:
            assert reply.status == INTERRUPTED and reply.stats is None
            if delay:
                assert 0 < len(reply.content) < len(full)
        # the reopened store takes new writes
        history.add_message(chat.id, "user", "and then?")
        assert history.messages(chat.id)[-1].content == "and then?"
