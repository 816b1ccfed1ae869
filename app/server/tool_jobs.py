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
:class:`DoneEvent` ends the job with the phases' tokens and stats added up. A call that
``max_tokens`` cuts short gets no ``</tool_call>`` (:func:`as_read` says what it gets):
its text never reaches a client, only the parser, which tells it as a partial call.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Generator, Iterator
from dataclasses import replace
from typing import Any

from tandem.app.server.jobs import JobUsage, generate_events
from tandem.app.server.loaded_models import Lane, ModelSlot
from tandem.app.server.openai import GenRequest
from tandem.app.server.tool_calls import CALL_CLOSE, CALL_OPEN, HEADER
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
                ids, stops = slot.engine.fit(msgs, req.reply_room, cancel=cancel, inputs=inputs)
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
            done, text = yield from _call(lane, ids, replace(req, max_tokens=left, grammar=call_grammar), cancel,
                                          client, None if phases else used)
            closed = text.endswith(CALL_CLOSE)  # (not when max_tokens cut the call short)
            ids += done.tokens
            if closed:
                ids += target.tokenize("\n" + CALL_CLOSE, add_bos=False, special=True)
            texts.append(text)
            calls += 1
            opened = False
            kept = done.tokens
            more = tools.parallel and calls < MAX_CALLS and not tools.forced
            if closed and not more and done.stats.finish_reason == "length":
                # The call is whole and the reply ends with it: the limit cut nothing.
                done = replace(done, stats=replace(done.stats, finish_reason="stop"))
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


def _call(lane: Lane, ids: list[int], req: GenRequest, cancel: threading.Event, client: str,
          used: JobUsage | None) -> Generator[Event, None, tuple[DoneEvent, str]]:
    """One call's phase: its events (``<tool_call>``, the JSON, its ending), and its
    :class:`DoneEvent` with the text those events carried.

    The events are held back until the call's header (``{"name": "...", "arguments": ``)
    is read: the parser gives nothing of a call before that anyway, and a call cut short
    before it can then be told as :func:`as_read` says, or not at all."""
    held: list[TokenEvent] | None = [TokenEvent(CALL_OPEN + "\n", [])]
    written = ""
    done = None
    for ev in generate_events(lane, ids, req, [], cancel, client, used):
        if isinstance(ev, DoneEvent):
            done = ev
        elif held is None:
            yield ev
        else:
            held.append(ev)
            written += ev.text
            if HEADER.match(written):
                yield from held
                held = None
    assert done is not None
    read = as_read(done.text, cut=done.stats.finish_reason in ("length", "cancelled"))
    if read is None:
        return done, ""
    if held is not None:  # nothing given yet, and what is given may differ from what was written
        text = CALL_OPEN + "\n" + read
        yield TokenEvent(text, [t for ev in held for t in ev.tokens])
        return done, text
    yield TokenEvent(read[len(done.text):], [])  # what was given is where ``read`` begins
    return done, CALL_OPEN + "\n" + read


NAMED = re.compile(r'\s*\{\s*"name"\s*:\s*"(?:[^"\\]|\\.)*"')
"""A call's JSON as far as its whole name (:data:`~.tool_calls.HEADER` reads on to the
arguments)."""


def as_read(call: str, *, cut: bool) -> str | None:
    """A call's JSON as :class:`~tandem.app.server.tool_calls.ToolCallParser` is to read
    it, its ending included; ``cut``: ``max_tokens`` (or a cancel) ended it.

    A whole call is followed by ``</tool_call>``. A cut one is told as OpenAI tells a call
    cut by the length limit: in ``tool_calls``, its arguments as far as they were written
    (rarely valid JSON), with no closing tag the model did not write and no markup as
    content; one cut before its name was whole is no call at all (``None``). The parser
    reads a call's last ``}`` as the end of the call object and takes it off, so a cut
    call gets that ``}`` here: its arguments then come out as written, even when they
    end in a ``}`` of their own (less trailing blanks, which the parser drops). Cut
    between its name and its arguments, it is given the rest of its header, so it comes
    out named, with empty arguments. This text only ever reaches the parser, never a
    client."""
    if not cut or _whole(call):
        return call + "\n" + CALL_CLOSE
    if HEADER.match(call):
        return call + "}"
    named = NAMED.match(call)
    return named.group(0) + ', "arguments": }' if named else None


def _whole(call: str) -> bool:
    """Whether a call's JSON is complete: cut at ``max_tokens`` just as its last ``}``
    came, it is a whole call."""
    try:
        return isinstance(json.loads(call), dict)
    except json.JSONDecodeError:
        return False


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
