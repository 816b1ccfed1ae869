"""The worker-thread job of a chat request that offers tools.

A call's JSON is always decoded under :func:`~tandem.app.server.tools.call_schema`'s
grammar, so its name is one of the tools' and its arguments fit that tool's schema:

- ``required`` or a named function: the reply opens with ``<tool_call>`` (written for
  the model) and the call's JSON follows under the grammar; the reply is that one call
  (a model left free after it may ramble on in text);
- ``auto``: the model writes freely until it opens a ``<tool_call>`` itself; then the
  call's JSON is decoded under the grammar, and after its ``</tool_call>`` the model may
  go on (another call when ``parallel_tool_calls``, or text);
- ``none``: tools are not shown to the model and it answers in text.

Each phase is one :func:`~tandem.runtime.generate.generate` run over the tokens so far,
so the KV cache of the previous phase is reused. The events carry the whole reply text,
the written tags included, for :class:`~tandem.app.server.tool_calls.ToolCallParser`; one
:class:`DoneEvent` ends the job with the phases' tokens and stats added up.
"""

from __future__ import annotations

import threading
from collections.abc import Generator, Iterator
from dataclasses import replace
from typing import Any

from tandem.app.server.jobs import JobUsage, generate_events
from tandem.app.server.loaded_models import Lane, ModelSlot
from tandem.app.server.openai import GenRequest
from tandem.app.server.tool_calls import CALL_CLOSE, CALL_OPEN
from tandem.app.server.tools import ToolRequest, for_template
from tandem.runtime.chat_fit import FitCancelled
from tandem.runtime.generate import DoneEvent, Event, TokenEvent

MAX_CALLS = 8
"""Most calls one reply may make (parallel_tool_calls)."""


def tool_chat_job(slot: ModelSlot, messages: list[dict[str, Any]], req: GenRequest, tools: ToolRequest,
                  call_grammar: Any, client: str = "", used: JobUsage | None = None):
    """``call_grammar``: the compiled :func:`call_schema` of the offered tools (``None``
    when none is offered)."""

    def run(cancel: threading.Event, lane: Lane) -> Generator[Event, None, None]:
        with lane.lock, lane.engaged():
            offered = tools.offered
            msgs, inputs = for_template(slot.target.chat_template(), messages, offered, req.template_variables)
            try:
                ids, stops = slot.engine.fit(msgs, req.max_tokens, cancel=cancel, inputs=inputs)
            except FitCancelled:  # the client went away (or the server stops): nothing to send
                return
            stops = [*stops, *req.stop]
            if not offered:
                yield from generate_events(lane, ids, req, stops, cancel, client, used)
                return
            yield from _phases(lane, ids, req, tools, call_grammar, stops, cancel, client, used)

    return run


def _phases(lane: Lane, prompt: list[int], req: GenRequest, tools: ToolRequest, call_grammar: Any,
            stops: list[str], cancel: threading.Event, client: str, used: JobUsage | None) -> Iterator[Event]:
    target = lane.target
    ids = list(prompt)
    texts: list[str] = []
    generated = 0
    phases: list[DoneEvent] = []
    calls = 0
    opened = tools.forced  # the reply begins with a call
    while generated < req.max_tokens and not cancel.is_set():
        left = req.max_tokens - generated
        if opened:  # a call: its JSON under the grammar, between tags written for the model
            ids += target.tokenize("\n" if phases else CALL_OPEN + "\n", add_bos=False, special=True)
            texts.append(CALL_OPEN + "\n")
            yield TokenEvent(CALL_OPEN + "\n", [])
            done = yield from _run(lane, ids, replace(req, max_tokens=left, grammar=call_grammar), [], cancel,
                                   client, None if phases else used)
            ids += done.tokens + target.tokenize("\n" + CALL_CLOSE, add_bos=False, special=True)
            texts += [done.text, "\n" + CALL_CLOSE]
            yield TokenEvent("\n" + CALL_CLOSE, [])
            calls += 1
            opened = False
            kept = done.tokens
            more = tools.parallel and calls < MAX_CALLS and not tools.forced
        else:  # free text, until the model opens a call
            done = yield from _run(lane, ids, replace(req, max_tokens=left), [*stops, CALL_OPEN], cancel, client,
                                   None if phases else used)
            kept, opened = _until_call(target, done.tokens)
            ids += kept
            texts.append(done.text)
            more = opened
        phases.append(done)
        generated += len(kept)
        if not more or done.stats.finish_reason in ("length", "cancelled"):
            break
    first, last = phases[0], phases[-1]
    stats = replace(last.stats, prompt_tokens=len(prompt), generated_tokens=generated, ttft_s=first.stats.ttft_s,
                    total_s=sum(p.stats.total_s for p in phases),
                    target_calls=sum(p.stats.target_calls for p in phases),
                    drafted_tokens=sum(p.stats.drafted_tokens for p in phases),
                    accepted_tokens=sum(p.stats.accepted_tokens for p in phases),
                    forced_tokens=sum(p.stats.forced_tokens for p in phases))
    yield DoneEvent("".join(texts), ids[len(prompt):], stats)


def _run(lane: Lane, ids: list[int], req: GenRequest, stops: list[str], cancel: threading.Event, client: str,
         used: JobUsage | None) -> Generator[Event, None, DoneEvent]:
    """One phase: its token events passed on, its :class:`DoneEvent` returned."""
    done = None
    for ev in generate_events(lane, ids, req, stops, cancel, client, used):
        if isinstance(ev, DoneEvent):
            done = ev
        else:
            yield ev
    assert done is not None
    return done


def _until_call(target: Any, tokens: list[int]) -> tuple[list[int], bool]:
    """The tokens up to the end of ``<tool_call>`` if the model opened a call (True), or
    all of them (False). A speculative round may have committed tokens past the tag;
    they are dropped, as the call's JSON is decoded afresh under the grammar."""
    text = b""
    for i, t in enumerate(tokens):
        text += target.token_bytes(t)
        if CALL_OPEN.encode() in text:
            return tokens[: i + 1], True
    return tokens, False
