"""Tool requests in OpenAI's shapes: ``tools``, ``tool_choice``, ``parallel_tool_calls``,
and the conversation's tool messages for a chat template.

:func:`call_schema` is the JSON schema one call must satisfy: the constrained part of a
reply when ``tool_choice`` is ``required`` or names a function, or once a call has
begun under ``auto``. Calls are read back from a reply by :mod:`.tool_calls`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from tandem.app.server.api_error import ApiError
from tandem.app.server.tool_calls import CALL_CLOSE, CALL_OPEN
from tandem.models.chat_template import TemplateInputs

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
    name one of ``tools``' and the arguments that tool's schema (:func:`own_resource`, so
    its ``$ref``s resolve inside it). ``name`` comes first, so a constrained reply says
    which tool before its arguments (and streams that way)."""
    variants = [{"type": "object",
                 "properties": {"name": {"const": t.name}, "arguments": own_resource(t.parameters, t.name)},
                 "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return variants[0] if len(variants) == 1 else {"anyOf": variants}


def own_resource(schema: dict[str, Any], name: str) -> dict[str, Any]:
    """A tool's parameters schema made a schema resource of its own (JSON Schema's
    ``$id``) when it holds a ``$ref``, so it keeps its meaning nested in the call's schema.

    A ``$ref`` resolves against the nearest enclosing ``$id``, else the document's root:
    nested under ``arguments`` with none, ``#/$defs/Address`` (Pydantic's nested models)
    would point into the call's schema, which has no ``$defs``, and ``#`` at the call
    itself. With its own ``$id`` every local reference (``$defs``, ``definitions``, any
    JSON pointer, ``#``, anchors) resolves inside the tool's schema, as it did when the
    client wrote it, and two tools that define the same name differently never clash.
    The compiler resolves ``$id`` as the spec does (tests/app/server/test_tool_schemas.py
    holds it to that). A schema without a reference stays as it is, and so does one
    that names its own ``$id`` (its references already resolve against it)."""
    if "$id" in schema or not _has_ref(schema):
        return schema
    return {"$id": f"urn:tandem:tool:{name}", **schema}


def _has_ref(value: Any) -> bool:
    """Whether a ``$ref`` key appears anywhere in ``value`` (one in data, say a property
    named ``$ref``, counts too: an ``$id`` it needlessly adds changes nothing)."""
    if isinstance(value, dict):
        return "$ref" in value or any(_has_ref(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_ref(v) for v in value)
    return False


# -- messages -------------------------------------------------------------------------

def template_has_tools(template: str | None) -> bool:
    """Whether a chat template renders ``tools`` itself (Qwen2.5's does)."""
    return bool(template) and "tools" in template


def for_template(template: str | None, messages: list[dict[str, Any]], offered: tuple[Tool, ...],
                 variables: dict[str, Any]) -> tuple[list[dict[str, Any]], TemplateInputs]:
    """The messages and what else to render them with: the tools for a template that
    renders them (otherwise :func:`plain_messages` describes them), and the request's
    template ``variables``."""
    if template_has_tools(template):
        return messages, TemplateInputs([t.definition for t in offered] or None, variables)
    return plain_messages(messages, offered), TemplateInputs(None, variables)


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
