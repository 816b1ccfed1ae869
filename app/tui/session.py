"""The chat logic under the TUI, free of any widget: load models, run one reply into the history.

Kept apart from Textual so the same code path the app's worker runs can be driven by a
plain process (the kill -9 durability test) and unit-tested without a screen.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from tandem.app.history import COMPLETE, INTERRUPTED, ChatRecord, History, MessageRecord
from tandem.kernels.sampling import SamplingParams
from tandem.models.errors import TandemError
from tandem.runtime.generate import DoneEvent, Event, TokenEvent

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


ProgressCallback = Callable[[TokenEvent, int, LiveStats], None]


def run_reply(
    engine: Any,
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
    settings = ChatSettings.from_dict(chat.params)
    stored = history.messages(chat.id)
    if resume is None:
        events = engine.stream(conversation(chat, stored), settings.params, settings.max_tokens,
                               stop=settings.stop, cancel=cancel)
        reply = history.start_reply(chat.id)
    else:
        events = continuation(engine, chat, stored, resume, settings, cancel)
        reply = resume
        history.finish_reply(reply.id, INTERRUPTED, reply.stats)  # interrupted until it ends again
    if on_start is not None:
        on_start(reply)
    live = LiveStats()
    token_bytes = getattr(getattr(engine, "target", None), "token_bytes", None)
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


def continuation(engine: Any, chat: ChatRecord, stored: Sequence[MessageRecord], partial: MessageRecord,
                 settings: ChatSettings, cancel: threading.Event | None) -> Iterator[Event]:
    """Continue ``partial``: the prompt is the conversation before it, ready for the
    assistant's turn, followed by the reply so far, so the model writes on from there."""
    before = [m for m in stored if m.id < partial.id]
    ids, stops = engine.fit(conversation(chat, before), settings.max_tokens)
    ids = ids + engine.target.tokenize(partial.content, add_bos=False)
    yield from engine.complete(ids, settings.params, settings.max_tokens, stop=[*stops, *settings.stop],
                               cancel=cancel)


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


@dataclass
class ModelChoice:
    """A target model and an optional drafter, as paths (names come from the file stems)."""

    target: Path
    drafter: Path | None = None
    n_ctx: int | None = 2048
    n_threads: int | None = None
    """llama.cpp threads; ``None`` is every core. One thread is best for tiny models and
    on a machine busy with other work (ggml's thread barriers spin)."""
    draft_mode: str | None = None
    """``runtime.speculative`` mode; ``None`` means ``auto`` with a drafter, else ``off``."""
    draft_max: int = 8
    draft_len: int | None = None
    measure_cost: bool = True
    """Measure the target's verify-cost curve (cached) for the adaptive draft length."""
    budget: str | None = None
    """Host memory the chat may use (``6GiB``); ``None``: the planner's default share of RAM."""
    notes: list[str] = field(default_factory=list)
    """What the memory planner changed (e.g. a drafter it dropped), for the UI to show."""
    placement: str = "auto"
    """Where drafter and target run: ``auto`` (measured once per pair and machine, cached),
    ``gpu``/``cpu`` (the drafter there) or ``target-gpu`` (see runtime.placement)."""
    fast_verify: bool = False
    """llama.cpp's fastest kernels and long verify calls instead of the exact
    configuration (``LlamaConfig.exact``): greedy replies may differ at near-ties."""

    @property
    def target_name(self) -> str:
        return self.target.stem

    @property
    def drafter_name(self) -> str | None:
        if self.drafter is not None:
            return self.drafter.stem
        return "model-free" if self.mode not in ("off", "model", "xvocab") else None

    @property
    def mode(self) -> str:
        return self.draft_mode or ("auto" if self.drafter is not None else "off")


def engine_record(choice: ModelChoice) -> dict[str, Any]:
    """What a chat stores to get its models back: file paths, not names (a model given
    with ``-m FILE`` has no name in the store)."""
    return {"target": str(choice.target), "drafter": str(choice.drafter) if choice.drafter else None,
            "draft_mode": choice.draft_mode}


def restored_choice(current: ModelChoice, record: dict[str, Any]) -> ModelChoice | None:
    """``current`` with a chat's stored models, or ``None`` when a stored file has gone."""
    target = Path(record.get("target") or "")
    drafter = Path(record["drafter"]) if record.get("drafter") else None
    if not record.get("target") or not target.exists() or (drafter is not None and not drafter.exists()):
        return None
    return replace(current, target=target, drafter=drafter, draft_mode=record.get("draft_mode"), notes=[])


def speculative_available() -> bool:
    try:
        from tandem.runtime import speculative
    except ImportError:
        return False
    return hasattr(speculative, "build_strategy")


@dataclass
class LoadProgress:
    """What a model load is doing, for the status line: loads, placement measurements and
    the first-use verify-cost measurement can take from one second to a minute."""

    name: str
    stage: str = "starting"
    started: float = field(default_factory=time.monotonic)

    def line(self, now: float | None = None) -> str:
        elapsed = (time.monotonic() if now is None else now) - self.started
        return f"Loading {self.name}: {self.stage}… {elapsed:.0f} s"


def load_engine(choice: ModelChoice, progress: Callable[[str], None] | None = None) -> Any:
    """Open the target (and the drafter) as a ChatEngine, speculative when asked for.

    One speculative strategy is built per engine and reused for every reply, so the
    drafter, its caches and the adaptive policy persist across turns. The drafter
    backend is opened here (same threads and context as the target) and handed to the
    strategy, so the engine can report its memory.
    """
    from tandem.runtime.chat import ChatEngine
    from tandem.runtime.open_backend import backend_kind, open_backend
    from tandem.runtime.planner import plan_for_run

    def say(stage: str) -> None:
        if progress is not None:
            progress(stage)

    wants_drafter = choice.drafter is not None and choice.mode != "off"
    if backend_kind(choice.target) != "gguf" or (wants_drafter and backend_kind(choice.drafter) != "gguf"):
        # ONNX exports and Hugging Face folders: the planner prices llama.cpp models only,
        # so such a target gets a budget check before it loads (BudgetError if it cannot fit).
        if backend_kind(choice.target) != "gguf":
            from tandem.runtime.plan_other import plan_unplanned

            plan_unplanned(choice.target, backend_kind(choice.target), choice.budget, choice.n_ctx)
        say("loading the model")
        target = open_backend(choice.target, n_ctx=choice.n_ctx, n_threads=choice.n_threads)
        plan, drafter_path = None, choice.drafter if wants_drafter else None
    else:
        # The memory planner sizes both models to the budget (BudgetError if nothing fits).
        say("planning memory")
        plan = plan_for_run(choice.target, choice.drafter if wants_drafter else None, choice.budget,
                            choice.n_ctx, threads=choice.n_threads, draft_max=choice.draft_max,
                            drop_slow_draft=False)
        drafter_path = choice.drafter if plan.draft is not None else None
        if wants_drafter and drafter_path is None:
            choice.notes.append("memory planner: " + "; ".join(plan.reasons))
        say("loading the model")
        target = open_backend(choice.target,
                              llama_config=replace(plan.target.llama_config(), exact=not choice.fast_verify))
    if choice.mode == "off" or (drafter_path is None and choice.mode in ("model", "xvocab")):
        return ChatEngine(target)
    drafter = None
    try:
        if not speculative_available():
            raise TandemError("Speculative decoding is not available in this build: run without a drafter.")
        from tandem.runtime.placement import Placed, place
        from tandem.runtime.speculative import SpecOptions, build_strategy

        planned = plan.draft if plan is not None else None
        placed = Placed()
        if planned is not None and drafter_path is not None and choice.mode in ("auto", "model", "xvocab"):
            say("placing the drafter (measured on a pair's first run)")
            placed = place(target, plan, mode=choice.mode, device=choice.placement, notify=choice.notes.append)
            target = placed.target  # reopened on the GPU when the target is placed there
            drafter_path = Path(placed.draft_path)  # the file the planner priced (maybe a quantized copy)
            if placed.choice is not None:
                choice.notes.append(f"placement: {placed.choice.option.name} (measured)")
        config = placed.llama_config
        say("loading the drafter")
        drafter = (open_backend(drafter_path, n_ctx=choice.n_ctx, n_threads=choice.n_threads, llama_config=config)
                   if drafter_path is not None and placed.draft_device != "cuda" else None)
        options = SpecOptions(mode=choice.mode, draft_max=plan.draft_max if plan else choice.draft_max,
                              draft_length=choice.draft_len, measure_cost=choice.measure_cost,
                              draft_window=planned.window if planned is not None else None,
                              draft_device=placed.draft_device, predraft=placed.predraft,
                              draft_cost=placed.draft_cost)
        say("preparing speculative decoding (the first run measures the model's speed)")
        strategy = build_strategy(target, drafter if drafter is not None else drafter_path, options,
                                  llama_config=config, torch_config=placed.torch_config)
    except BaseException:
        if drafter is not None:
            drafter.close()
        target.close()
        raise
    return ChatEngine(target, strategy, drafter=drafter)


def close_engine(engine: Any) -> None:
    """Free the engine's strategy and models (``None`` is fine: nothing was loaded)."""
    if engine is not None:
        engine.close()
