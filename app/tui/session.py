"""The chat logic under the TUI, free of any widget: run one reply into the history.

Kept apart from Textual so the same code path the app's worker runs can be driven by a
plain process (the kill -9 durability test) and unit-tested without a screen. Loading
the models is :mod:`tandem.app.tui.model_choice`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from tandem.app.history.database import COMPLETE, INTERRUPTED, ChatRecord, History, MessageRecord
from tandem.errors import TandemError
from tandem.kernels.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem.runtime.chat import ChatEngine
    from tandem.runtime.generate import DoneEvent, TokenEvent

DEFAULT_MAX_TOKENS = 512


@dataclass
class ChatSettings:
    """Per-chat settings, stored as JSON in ``chats.params``."""

    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = DEFAULT_MAX_TOKENS
    stop: list[str] = field(default_factory=list)
    """Extra stop strings (the chat template adds its own)."""

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self.params), "max_tokens": self.max_tokens, "stop": list(self.stop)}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> ChatSettings:
        """Unknown keys are ignored and missing ones take defaults (older/newer files)."""
        data = dict(data or {})
        names = {f.name for f in fields(SamplingParams)}
        params = SamplingParams(**{k: v for k, v in data.items() if k in names})
        return cls(params, int(data.get("max_tokens", DEFAULT_MAX_TOKENS)),
                   [str(s) for s in data.get("stop") or []])


def conversation(chat: ChatRecord, messages: Sequence[MessageRecord]) -> list[dict[str, str]]:
    """What the model sees: the chat's system prompt, then every non-empty message."""
    out = [{"role": "system", "content": chat.system_prompt}] if chat.system_prompt.strip() else []
    out += [{"role": m.role, "content": m.content} for m in messages if m.content or m.role == "user"]
    return out


def title_from(text: str, width: int = 40) -> str:
    """A chat title from its first message: first line, whitespace squeezed, shortened."""
    line = " ".join(text.strip().splitlines()[0].split()) if text.strip() else "New chat"
    return line if len(line) <= width else line[: width - 1].rstrip() + "…"


@dataclass
class LiveStats:
    """Stats of a reply while it streams, and the drafted character spans for colouring."""

    started: float = field(default_factory=time.perf_counter)
    first_at: float | None = None
    last_at: float | None = None
    tokens: int = 0
    drafted: int = 0
    chars: int = 0
    drafted_spans: list[list[int]] = field(default_factory=list)

    def on_token(self, event: TokenEvent, drafted_chars: int, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        if self.first_at is None and event.tokens:
            self.first_at = now
        self.last_at = now
        self.tokens += len(event.tokens)
        self.drafted += event.drafted
        if drafted_chars > 0:
            start = self.chars
            if self.drafted_spans and self.drafted_spans[-1][1] == start:
                self.drafted_spans[-1][1] = start + drafted_chars
            else:
                self.drafted_spans.append([start, start + drafted_chars])
        self.chars += len(event.text)

    def snapshot(self) -> dict[str, Any]:
        """Figures known mid-stream (the final ones come from the DoneEvent)."""
        out: dict[str, Any] = {"generated_tokens": self.tokens, "live": True}
        if self.first_at is not None:
            out["ttft_s"] = self.first_at - self.started
            span = (self.last_at or self.first_at) - self.first_at
            if self.tokens > 1 and span > 0:  # decode speed: undefined before the second token
                out["tokens_per_s"] = (self.tokens - 1) / span
        if self.drafted:
            out["drafted_share"] = self.drafted / max(1, self.tokens)
        return out


def drafted_chars(event: TokenEvent, token_bytes: Callable[[int], bytes] | None) -> int:
    """How many characters of ``event.text`` came from drafted tokens (the leading ones).

    Exact when the detokenizer emits a commit's text at once; at a UTF-8 split or a
    held-back stop-string prefix it can be off by those few characters, which only
    affects colouring.
    """
    if not event.drafted or not event.text:
        return 0
    if event.drafted >= len(event.tokens) or token_bytes is None:
        return len(event.text) if event.drafted >= len(event.tokens) else 0
    raw = b"".join(token_bytes(t) for t in event.tokens[: event.drafted])
    return min(len(raw.decode("utf-8", errors="ignore")), len(event.text))


def final_stats(done: DoneEvent, live: LiveStats, memory: dict[str, int], model: str,
                drafter: str | None) -> dict[str, Any]:
    """The stats stored with a reply: the generator's figures, memory, drafted spans."""
    stats = done.stats.as_dict()
    stats.update(memory={k: int(v) for k, v in memory.items()}, model=model)
    if drafter:
        stats["drafter"] = drafter
    if live.drafted_spans:
        stats["drafted_spans"] = live.drafted_spans
    return stats


class ReplyBuffer:
    """Text a worker has streamed but the UI has not drawn yet (thread-safe).

    The UI drains it on a timer, so rendering costs at most a few redraws a second
    whatever the token rate, and generation is not slowed down by the screen.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._text: list[str] = []
        self._spans: list[list[int]] = []
        self._live: dict[str, Any] | None = None

    def push(self, text: str, live: LiveStats) -> None:
        with self._lock:
            self._text.append(text)
            self._spans = [list(s) for s in live.drafted_spans]
            self._live = live.snapshot()

    def drain(self) -> tuple[str, list[list[int]], dict[str, Any]] | None:
        with self._lock:
            if self._live is None:
                return None
            out = ("".join(self._text), self._spans, self._live)
            self._text, self._live = [], None
            return out


ProgressCallback = Callable[["TokenEvent", int, LiveStats], None]


def run_reply(
    engine: ChatEngine,
    history: History,
    chat: ChatRecord,
    *,
    cancel: threading.Event | None = None,
    on_token: ProgressCallback | None = None,
    on_start: Callable[[MessageRecord], None] | None = None,
    model_name: str = "",
    drafter_name: str | None = None,
    resume: MessageRecord | None = None,
) -> MessageRecord:
    """Stream the assistant's reply to ``chat`` into a new message, committing as it goes.

    The message is created ``interrupted`` and every fragment is committed at once, so
    a crash keeps what was produced; it is marked ``complete`` only when generation ends
    on its own (a stop, end-of-generation or the token limit). A :class:`TandemError`
    (a prompt that cannot fit, ...) is stored with the message and re-raised.
    With ``resume`` (an interrupted reply, the chat's last message) the model continues
    that reply where it stopped, and the new text is appended to it.
    """
    # local: the reply's worker thread imports the runtime, not the chat app's first paint
    from tandem.runtime.generate import DoneEvent

    settings = ChatSettings.from_dict(chat.params)
    stored = history.messages(chat.id)
    if resume is not None:  # the conversation before it, then the reply so far
        stored = [m for m in stored if m.id < resume.id]
    events = engine.stream(conversation(chat, stored), settings.params, settings.max_tokens, stop=settings.stop,
                           cancel=cancel, reply_prefix=resume.content if resume is not None else "", keep_start=True)
    if resume is None:
        reply = history.start_reply(chat.id)
    else:
        reply = resume
        history.finish_reply(reply.id, INTERRUPTED, reply.stats)  # interrupted until it ends again
    if on_start is not None:
        on_start(reply)
    live = LiveStats()
    token_bytes = engine.target.token_bytes
    status, stats = INTERRUPTED, None
    try:
        for event in events:
            if isinstance(event, DoneEvent):
                finished = event.stats.finish_reason != "cancelled" and not (cancel and cancel.is_set())
                status = COMPLETE if finished else INTERRUPTED
                stats = final_stats(event, live, engine.stats_memory(), model_name, drafter_name)
                if resume is not None:
                    stats = continued_stats(resume.stats, stats, len(resume.content))
                break
            n_drafted = drafted_chars(event, token_bytes)
            live.on_token(event, n_drafted)
            history.append(reply.id, event.text)
            if on_token is not None:
                on_token(event, n_drafted, live)
    except TandemError as exc:
        stats = {**live.snapshot(), "error": str(exc), "model": model_name}
        stats.pop("live", None)
        history.finish_reply(reply.id, INTERRUPTED, stats)
        raise
    finally:
        if stats is None:
            stats = {**live.snapshot(), "model": model_name, "finish_reason": "cancelled"}
            stats.pop("live", None)
            if resume is not None:
                stats = continued_stats(resume.stats, stats, len(resume.content))
        if not (stats.get("error")):
            history.finish_reply(reply.id, status, stats)
    return history.get_message(reply.id)


def continued_stats(before: dict[str, Any] | None, after: dict[str, Any], offset: int) -> dict[str, Any]:
    """Stats of a reply continued once or more: the latest run's figures, token counts of
    every run added up, drafted spans moved past the text that was already there."""
    before = before or {}
    out = dict(after)
    out["generated_tokens"] = before.get("generated_tokens", 0) + after.get("generated_tokens", 0)
    out["continued"] = before.get("continued", 0) + 1
    spans = [list(s) for s in before.get("drafted_spans", [])]
    spans += [[a + offset, b + offset] for a, b in after.get("drafted_spans", [])]
    if spans:
        out["drafted_spans"] = spans
    return out
