"""A chat request's conversation: its ``messages`` (roles, text content or text parts, an
assistant's earlier ``tool_calls``, a tool's result) and the template variables it sets
(``chat_template_kwargs``), validated into what the chat template renders."""

from __future__ import annotations

import contextlib
import json
from typing import Any

from tandem.app.server.api_error import ApiError
from tandem.app.server.openai import new_call_id
from tandem.models.chat_template import RESERVED


def parse_template_variables(body: dict) -> dict[str, Any]:
    """``chat_template_kwargs`` (llama-server's and vLLM's): variables the model's chat
    template reads, such as Qwen3's ``enable_thinking``; a template that reads none
    renders as without them."""
    raw = body.get("chat_template_kwargs")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ApiError(400, "'chat_template_kwargs' must be an object of template variables.", "invalid_value",
                       "chat_template_kwargs")
    taken = sorted(RESERVED & raw.keys())
    if taken:
        raise ApiError(400, f"'chat_template_kwargs' cannot set {taken[0]!r}: the server sets it.", "invalid_value",
                       "chat_template_kwargs")
    return raw


def parse_messages(body: dict) -> list[dict[str, Any]]:
    """The conversation, each message ``{"role", "content"}`` with its content as text; an
    assistant message that called tools keeps its ``tool_calls`` and a ``tool`` message
    its ``tool_call_id``, for chat templates that render them."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' must be a non-empty list.", "invalid_value", "messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer", "tool"):
            raise ApiError(400, f"messages[{i}] needs a role of system, user, assistant or tool.",
                           "invalid_value", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            content = _text_parts(content, i)
        elif content is None and m["role"] == "assistant":  # an assistant turn that only called tools
            content = ""
        elif content is None:  # as OpenAI: only an assistant's turn may come without it
            raise ApiError(400, f"messages[{i}] ({m['role']}) needs its 'content'.", "invalid_value", "messages")
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string.", "invalid_value", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        message: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = assistant_tool_calls(m["tool_calls"], i)
        elif role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str):
                raise ApiError(400, f"messages[{i}] is a tool result and needs its 'tool_call_id' (a string).",
                               "invalid_value", "messages")
            message["tool_call_id"] = call_id
            if isinstance(m.get("name"), str):
                message["name"] = m["name"]
        out.append(message)
    return out


def assistant_tool_calls(raw: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` (a call the model made earlier), for the chat
    template: ``function.arguments`` is decoded from its JSON string, as templates write
    it with ``tojson``."""
    if not isinstance(raw, list):
        raise ApiError(400, f"messages[{i}].tool_calls must be a list.", "invalid_value", "messages")
    out = []
    for j, call in enumerate(raw):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, f"messages[{i}].tool_calls[{j}] must be {{\"id\", \"type\": \"function\", "
                           "\"function\": {\"name\", \"arguments\"}}.", "invalid_value", "messages")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            with contextlib.suppress(json.JSONDecodeError):  # else kept as the text the model wrote
                args = json.loads(args) if args.strip() else {}
        call_id = call.get("id")
        out.append({"id": call_id if isinstance(call_id, str) else new_call_id(), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def _text_parts(parts: list, i: int) -> str:
    texts = []
    for j, p in enumerate(parts):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind != "text":  # an image (or audio, a file) would be silently lost on a text model
            raise ApiError(400, f"messages[{i}].content[{j}] is a {str(kind)[:40]!r} part; this server reads "
                           "text parts only.", "unsupported_content", "messages")
        text = p.get("text")
        if not isinstance(text, str):
            raise ApiError(400, f"messages[{i}].content: a text part's 'text' must be a string.",
                           "invalid_value", "messages")
        texts.append(text)
    return "".join(texts)
