"""Tool calling in OpenAI's shapes: ``tools``, ``tool_choice``, ``parallel_tool_calls``,
and the ``tool_calls`` a reply carries.

A model calls a tool by writing Hermes-style blocks, the format Qwen2.5's chat template
asks for (and the one this module teaches a model whose template has no tool support)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Oslo"}}
    </tool_call>

:class:`ToolCallParser` splits a reply's text into content and such calls as it streams,
so a streamed reply and a whole one are cut by the same code and reassemble alike.
:func:`call_schema` is the JSON schema one call must satisfy: the constrained part of a
reply when ``tool_choice`` is ``required`` or names a function, or once a call has
begun under ``auto``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from tandem.app.server.openai import ApiError, new_call_id

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
FENCE = "```"
MAX_TOOLS = 128
NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
"""OpenAI's rule for a function's name."""


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]
    """The arguments' JSON schema (an object schema; ``{}`` when the tool takes none)."""
    definition: dict[str, Any]
    """The tool as the client sent it (``{"type": "function", "function": {...}}``), for
    the chat template."""


@dataclass(frozen=True)
class ToolRequest:
    """What a request asked for: its tools, ``tool_choice`` and ``parallel_tool_calls``."""

    tools: tuple[Tool, ...]
    choice: Literal["auto", "none", "required", "function"] = "auto"
    function: str | None = None
    """The one function ``tool_choice`` names (``choice == "function"``)."""
    parallel: bool = True

    @property
    def offered(self) -> tuple[Tool, ...]:
        """The tools the model may call now (none under ``"none"``; the named one)."""
        if self.choice == "none":
            return ()
        if self.choice == "function":
            return tuple(t for t in self.tools if t.name == self.function)
        return self.tools

    @property
    def forced(self) -> bool:
        """The reply must be a call (``required`` or a named function)."""
        return self.choice in ("required", "function")


def parse_tools(body: dict) -> ToolRequest | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls``, validated; ``None`` when
    the request offers no tools."""
    raw = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise ApiError(400, "'parallel_tool_calls' must be true or false.", "invalid_value", "parallel_tool_calls")
    if raw is None or raw == []:
        if choice not in (None, "none", "auto"):
            raise ApiError(400, "'tool_choice' needs 'tools' to choose from.", "invalid_value", "tool_choice")
        return None
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise ApiError(400, f"'tools' must be a list of at most {MAX_TOOLS} tools.", "invalid_value", "tools")
    tools = tuple(_tool(t, i) for i, t in enumerate(raw))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ApiError(400, "'tools' names a function twice; each function needs its own name.",
                       "invalid_value", "tools")
    mode, function = _choice(choice, names)
    return ToolRequest(tools, mode, function, parallel)


def _tool(t: Any, i: int) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
        raise ApiError(400, f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}.",
                       "invalid_value", "tools")
    fn = t["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise ApiError(400, f"{where}.function.name must be 1 to 64 letters, digits, '_', '-' or '.'; got {name!r}.",
                       "invalid_value", "tools")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise ApiError(400, f"{where}.function.description must be a string.", "invalid_value", "tools")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise ApiError(400, f"{where}.function.parameters must be a JSON schema object.", "invalid_value", "tools")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ApiError(400, f"{where}.function.strict must be true or false.", "invalid_value", "tools")
    definition = {"type": "function", "function": {k: v for k, v in
                                                   (("name", name), ("description", description),
                                                    ("parameters", params)) if v is not None}}
    return Tool(name, params, definition)


def _choice(choice: Any, names: list[str]) -> tuple[Literal["auto", "none", "required", "function"], str | None]:
    if choice is None or choice == "auto":
        return "auto", None
    if choice in ("none", "required"):
        return choice, None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise ApiError(400, f"'tool_choice' names the function {name!r}, which is not in 'tools'.",
                           "invalid_value", "tool_choice")
        return "function", name
    raise ApiError(400, "'tool_choice' must be \"auto\", \"none\", \"required\" or "
                   "{\"type\": \"function\", \"function\": {\"name\": ...}}.", "invalid_value", "tool_choice")


def call_schema(tools: tuple[Tool, ...]) -> dict[str, Any]:
    """The JSON schema of one call's object, ``{"name": ..., "arguments": {...}}``: the
    name one of ``tools``' and the arguments that tool's schema. ``name`` comes first, so
    a constrained reply says which tool before its arguments (and streams that way)."""
    variants = [{"type": "object",
                 "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                 "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return variants[0] if len(variants) == 1 else {"anyOf": variants}


# -- messages -------------------------------------------------------------------------

def template_has_tools(template: str | None) -> bool:
    """Whether a chat template renders ``tools`` itself (Qwen2.5's does)."""
    return bool(template) and "tools" in template


def plain_messages(messages: list[dict[str, Any]], tools: tuple[Tool, ...]) -> list[dict[str, Any]]:
    """The conversation for a template without tool support: the tools described in the
    system message, earlier calls written as the calls the model would write, and tool
    results as user turns, all in the same Hermes format the reply is parsed in."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            text = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_result"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + text}
            else:
                out.append({"role": "user", "content": text, "tool_result": True})
        elif m.get("tool_calls"):
            calls = "\n".join(f"{CALL_OPEN}\n{json.dumps(c['function'])}\n{CALL_CLOSE}" for c in m["tool_calls"])
            out.append({"role": "assistant", "content": "\n".join(p for p in (m["content"], calls) if p)})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    for m in out:
        m.pop("tool_result", None)
    if tools:
        system = tools_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def tools_prompt(tools: tuple[Tool, ...]) -> str:
    listing = "\n".join(json.dumps(t.definition) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"The functions, one JSON signature a line:\n<tools>\n{listing}\n</tools>\n\n"
            "For each function call, reply with a JSON object with the function's name and arguments "
            f"within {CALL_OPEN}{CALL_CLOSE} tags:\n{CALL_OPEN}\n"
            "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n" + CALL_CLOSE)


# -- replies ------------------------------------------------------------------------

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
    ```` ```json ```` block holding ``{"name", "arguments"}``, or a reply that is only
    such objects. With ``names`` (the offered tools) those are calls too when they name
    one of them; a fenced block is held back until it closes, a reply that opens with
    ``{`` until it ends, then given as calls or as the content it was.
    """

    names: frozenset[str] = frozenset()
    calls: int = 0
    state: Literal["text", "header", "args", "fence", "bare"] = "text"
    buf: str = ""
    after_call: bool = False
    started: bool = False
    """Content has been given (a reply that opens with ``{`` no longer can)."""
    blank: str = ""
    """The whitespace before an open fence."""

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
                tag, fence = self.buf.find(CALL_OPEN), self.buf.find(FENCE) if self.names else -1
                at = min(i for i in (tag, fence, len(self.buf)) if i >= 0)
                if at == len(self.buf):
                    keep = max(_partial_suffix(self.buf, CALL_OPEN), _partial_suffix(self.buf, FENCE) if self.names else 0)
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
                    self.buf = self.buf[at:]
                    self.state = "fence"
            elif self.state == "fence":
                end = self.buf.find(FENCE, len(FENCE))
                if end < 0:
                    break
                block, self.buf = self.buf[: end + len(FENCE)], self.buf[end + len(FENCE):]
                calls = self._calls_in(block[len(FENCE):-len(FENCE)].removeprefix("json"))
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
            calls = self._calls_in(self.buf) if self.state == "bare" else []
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
            found = json.loads(text)
            objs = found if isinstance(found, list) else [found]
        except json.JSONDecodeError:
            try:
                objs = [json.loads(line) for line in text.splitlines() if line.strip()]
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
