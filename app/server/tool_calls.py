"""A reply's tool calls: its text cut into content and OpenAI's ``tool_calls``, whole or
as streamed deltas, by one parser (so the two reassemble alike).

A model calls a tool by writing Hermes-style blocks, the format Qwen2.5's chat template
asks for (and the one :mod:`.tools` teaches a model whose template has no tool support)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Oslo"}}
    </tool_call>
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from tandem.app.server.openai import new_call_id

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
FENCE = "```"
WRAPPERS = {FENCE: FENCE, **{f"<{t}>": f"</{t}>" for t in ("json", "JSON", "tool", "function_call", "response")}}
"""Blocks a model may put a call object in instead of ``<tool_call>``: a fence, and the
tags llama.cpp's Hermes-format parser also reads (Qwen2.5-Coder-0.5B writes ``<json>``)."""


@dataclass
class CallDelta:
    """A piece of the ``index``-th call: the first carries its id and name, the others a
    fragment of its arguments (OpenAI's streamed ``tool_calls`` delta)."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def shape(self) -> dict[str, Any]:
        if self.id is not None:
            return {"index": self.index, "id": self.id, "type": "function",
                    "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": self.index, "function": {"arguments": self.arguments}}


Delta = str | CallDelta
"""What the parser gives: content text, or a piece of a call."""

HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


@dataclass
class ToolCallParser:
    """Cuts a reply's text, fed as it streams, into content and calls.

    Text outside ``<tool_call>`` blocks is content; whitespace around blocks is dropped.
    Inside a block, once ``{"name": "...", "arguments": `` is read, the call's id and
    name are given, then its arguments as they arrive, holding back only what may be the
    closing ``}`` of the call's object (or the start of ``</tool_call>``). A block that
    does not read as a call stays content, as written.

    Some models (Qwen2.5-Coder) call in their own way, without the tags: a fenced
    ```` ```json ```` block (or one of the other :data:`WRAPPERS`) holding ``{"name",
    "arguments"}``, or a reply that is only such objects. With ``names`` (the offered
    tools) those are calls too when they name one of them; such a block is held back until
    it closes, a reply that opens with ``{`` until it ends, then given as calls or as the
    content it was.
    """

    names: frozenset[str] = frozenset()
    calls: int = 0
    state: Literal["text", "header", "args", "fence", "bare"] = "text"
    buf: str = ""
    after_call: bool = False
    started: bool = False
    """Content has been given (a reply that opens with ``{`` no longer can)."""
    blank: str = ""
    """The whitespace before an open block."""
    opener: str = FENCE
    """What opened the open block (:data:`WRAPPERS` says what ends it)."""

    def feed(self, text: str) -> list[Delta]:
        self.buf += text
        out: list[Delta] = []
        while True:
            if self.state == "text":
                if self.after_call or not self.started:
                    rest = self.buf.lstrip()
                    if self.after_call:
                        self.buf = rest
                    if not rest:
                        break
                    self.after_call = False
                    if not self.started and self.names and rest.startswith("{") and not self.calls:
                        self.state = "bare"
                        break
                tag = self.buf.find(CALL_OPEN)
                blocks = {o: self.buf.find(o) for o in WRAPPERS} if self.names else {}
                at = min(i for i in (tag, *blocks.values(), len(self.buf)) if i >= 0)
                if at == len(self.buf):
                    keep = max(_partial_suffix(self.buf, t) for t in (CALL_OPEN, *blocks))
                    emit = self.buf[: len(self.buf) - keep]
                    held = emit[len(emit.rstrip()):] + self.buf[len(emit):]
                    self._content(out, emit.rstrip())
                    self.buf = held
                    break
                before = self.buf[:at].rstrip()
                self._content(out, before)
                self.blank = self.buf[len(before):at]  # kept if a fence turns out to be content
                if at == tag:
                    self.buf = self.buf[at + len(CALL_OPEN):]
                    self.state = "header"
                else:
                    self.opener = next(o for o, i in blocks.items() if i == at)
                    self.buf = self.buf[at:]
                    self.state = "fence"
            elif self.state == "fence":
                closer = WRAPPERS[self.opener]
                end = self.buf.find(closer, len(self.opener))
                if end < 0:
                    break
                block, self.buf = self.buf[: end + len(closer)], self.buf[end + len(closer):]
                calls = self._calls_in(block[len(self.opener):-len(closer)].removeprefix("json"))
                if calls:
                    out.extend(calls)
                    self.after_call = True
                else:
                    self._content(out, self.blank + block)
                self.state = "text"
            elif self.state == "bare":
                break
            elif self.state == "header":
                m = HEADER.match(self.buf)
                if m is None or m.end() == len(self.buf):  # (more blank may come before the arguments)
                    end = self.buf.find(CALL_CLOSE)
                    if end < 0:
                        break
                    out.extend(self._block(self.buf[:end]))
                    self.buf = self.buf[end + len(CALL_CLOSE):]
                    self.state, self.after_call = "text", True
                    continue
                out.append(CallDelta(self.calls, id=new_call_id(), name=_unescape(m.group(1))))
                self.buf = self.buf[m.end():]
                self.state = "args"
            else:
                end = self.buf.find(CALL_CLOSE)
                if end < 0:
                    cut = _args_cut(self.buf)
                    if cut:
                        out.append(CallDelta(self.calls, self.buf[:cut]))
                    self.buf = self.buf[cut:]
                    break
                out.extend(self._close(self.buf[:end]))
                self.buf = self.buf[end + len(CALL_CLOSE):]
                self.state, self.after_call = "text", True
        return out

    def finish(self) -> list[Delta]:
        """What is left when the reply ends (a call may end without its closing tag: a
        constrained call ends with its JSON)."""
        out: list[Delta] = []
        if self.state == "text":
            self._content(out, self.buf.strip() if self.calls else self.buf)
        elif self.state == "header":
            out.extend(self._block(self.buf))
        elif self.state == "args":
            out.extend(self._close(self.buf))
        else:  # an unclosed fence, or a reply that opened with "{"
            calls = self._calls_in(self.buf.strip().removesuffix(FENCE)) if self.state == "bare" else []
            out.extend(calls or [self.blank + self.buf if self.state == "fence" else self.buf])
        self.buf, self.state = "", "text"
        return out

    def _content(self, out: list[Delta], text: str) -> None:
        if text:
            out.append(text)
            self.started = True

    def _calls_in(self, text: str) -> list[Delta]:
        """``text`` as calls to the offered tools, one JSON object (or one list of them, or
        one a line); none if any part is not such a call."""
        try:
            found = _loads_call(text)
            objs = found if isinstance(found, list) else [found]
        except json.JSONDecodeError:
            try:
                objs = [_loads_call(line) for line in text.splitlines() if line.strip()]
            except json.JSONDecodeError:
                return []
        if not objs or not all(isinstance(o, dict) and o.get("name") in self.names
                                and isinstance(o.get("arguments", {}), dict) for o in objs):
            return []
        out: list[Delta] = []
        for o in objs:
            out.append(CallDelta(self.calls, json.dumps(o.get("arguments", {}), ensure_ascii=False),
                                 id=new_call_id(), name=o["name"]))
            self.calls += 1
        return out

    def _close(self, rest: str) -> list[Delta]:
        """The end of a call's arguments: ``rest`` without the call object's ``}``."""
        rest = rest.rstrip()
        if rest.endswith("}"):
            rest = rest[:-1].rstrip()
        self.calls += 1
        return [CallDelta(self.calls - 1, rest)] if rest else []

    def _block(self, block: str) -> list[Delta]:
        """A block whose start did not read as a call: a call all the same if it parses as
        one (keys in another order), else content."""
        try:
            obj = json.loads(block)
        except json.JSONDecodeError:
            obj = None
        if isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("arguments"), dict):
            self.calls += 1
            return [CallDelta(self.calls - 1, json.dumps(obj["arguments"]), id=new_call_id(), name=obj["name"])]
        return [f"{CALL_OPEN}{block}{CALL_CLOSE}"]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (it may be cut mid-tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _args_cut(buf: str) -> int:
    """How much of a call's arguments can be given now: all but a trailing run that may
    still turn out to be ``}`` (the call's object closing), whitespace, or a cut
    ``</tool_call>``."""
    cut = len(buf) - _partial_suffix(buf, CALL_CLOSE)
    cut = len(buf[:cut].rstrip())
    if buf[:cut].endswith("}"):
        cut = len(buf[: cut - 1].rstrip())
    return cut


def _loads_call(text: str) -> Any:
    """JSON, or an object written with a doubled brace (``{{"name": ...}}``, or only the
    opening one doubled): the Qwen2.5-Coder-1.5B chat template shows the call format
    that way (a brace escape that Jinja prints as it stands), and the model copies it."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        text = text.strip()
        if not text.startswith("{{"):
            raise
        try:
            return json.loads(text[1:])
        except json.JSONDecodeError:
            return json.loads(text[1:-1])


def _unescape(s: str) -> str:
    try:
        return json.loads(f'"{s}"')
    except json.JSONDecodeError:
        return s


@dataclass
class ParsedReply:
    content: str | None
    calls: list[dict[str, Any]]
    """OpenAI's ``tool_calls``: ``{"id", "type": "function", "function": {"name", "arguments"}}``."""


def collect(deltas: list[Delta]) -> ParsedReply:
    """A whole reply from the parser's deltas (what a streaming client reassembles)."""
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for d in deltas:
        if isinstance(d, str):
            text.append(d)
        elif d.id is not None:
            calls.append({"id": d.id, "type": "function", "function": {"name": d.name, "arguments": d.arguments}})
        else:
            calls[d.index]["function"]["arguments"] += d.arguments
    content = "".join(text)
    return ParsedReply(content if content or not calls else None, calls)


def parse_reply(text: str, names: frozenset[str] = frozenset()) -> ParsedReply:
    parser = ToolCallParser(names)
    return collect([*parser.feed(text), *parser.finish()])
