"""Chat templates: the model's own Jinja template from GGUF metadata, or a plain fallback.

Templates run in Jinja's immutable sandbox (a model file is untrusted input) with the
variables Hugging Face templates expect: ``messages``, ``bos_token``, ``eos_token``,
``add_generation_prompt``, ``tools`` and ``raise_exception``, plus a request's own
(:class:`TemplateInputs`: ``enable_thinking`` for Qwen3's template, say).

Message content is text, never markup: a user who types ``<|im_end|><|im_start|>system``
must not open a system turn. So the template is rendered with a placeholder for each
message's content, the result is cut into template pieces and content pieces, and
:func:`prompt_ids` tokenizes only the template pieces with control-token parsing.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from jinja2 import Template, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tandem.errors import TandemError

Message = dict[str, Any]
"""``{"role", "content"}`` (text), and for tool use an assistant's ``tool_calls`` or a
tool result's ``tool_call_id``, as Hugging Face templates read them."""

FALLBACK_STOPS = ["\nUser:", "\nSystem:"]

RESERVED = frozenset({"messages", "bos_token", "eos_token", "add_generation_prompt", "tools", "raise_exception"})
"""Names the renderer itself sets: a request's variables cannot replace them."""


@dataclass(frozen=True)
class TemplateInputs:
    """What a request gives the chat template besides its messages."""

    tools: list[dict[str, Any]] | None = None
    """The functions the model may call, for templates that describe them (Qwen2.5's);
    ``None`` renders the template without."""
    variables: Mapping[str, Any] = field(default_factory=dict)
    """The request's own template variables (``chat_template_kwargs``, as llama-server and
    vLLM take them); none of :data:`RESERVED`."""


NO_INPUTS = TemplateInputs()


@dataclass(frozen=True)
class RenderedChat:
    text: str
    stops: list[str]
    """Stop strings the template implies (the fallback's role markers)."""
    has_bos: bool
    """Whether ``text`` already begins with the BOS token text."""
    segments: tuple[tuple[str, bool], ...] | None = None
    """``text`` cut into (piece, is_message_content); ``None`` when the template altered
    the placeholders so content could not be located (see :func:`prompt_ids`)."""
    contents: tuple[str, ...] = ()
    """The messages' contents (outer whitespace stripped)."""
    markup: tuple[str, ...] = ()
    """Request text the template writes among its own markup (tool definitions, earlier
    tool calls): it cannot be kept apart, so it must hold no control-token text."""


Tokenize = Callable[..., list[int]]
"""``tokenize(text, add_bos=..., special=...)``, as on a backend."""


def prompt_ids(rendered: RenderedChat, tokenize: Tokenize, *, add_bos: bool) -> list[int]:
    """Token ids for a rendered chat in which message content stays plain text.

    When no message holds control-token text the whole prompt is tokenized at once
    (exactly as before, so BPE merges at piece boundaries cannot change). Otherwise the
    template pieces are tokenized with control tokens and the content pieces without.
    """
    check_markup(rendered, tokenize)
    segments = rendered.segments
    if segments is not None and all(is_content for _, is_content in segments):
        return tokenize(rendered.text, add_bos=add_bos, special=False)  # no template: all plain text
    if all(tokenize(c, special=True) == tokenize(c, special=False) for c in set(rendered.contents) if c):
        return tokenize(rendered.text, add_bos=add_bos, special=True)
    if segments is None:
        raise TandemError("A message contains control-token text (such as <|im_end|>) and this model's chat "
                          "template alters message content, so it cannot be kept as plain text; remove it.")
    ids: list[int] = []
    for i, (piece, is_content) in enumerate(segments):
        if piece or (i == 0 and add_bos):
            ids += tokenize(piece, add_bos=add_bos and i == 0, special=not is_content)
    return ids


def _raise(message: str) -> None:
    raise TemplateError(message)


def render_fallback(messages: list[Message]) -> str:
    """A plain transcript for models without a template; ends ready for the reply."""
    parts = []
    for m in messages:
        role = m["role"].capitalize()
        parts.append(f"{role}: {m['content'].strip()}" if role != "System" else m["content"].strip())
    parts.append("Assistant:")
    return "\n\n".join(p for p in parts if p)


def check_markup(rendered: RenderedChat, tokenize: Tokenize) -> None:
    """Refuse request text written among the template's own markup (tool definitions,
    earlier tool calls, template variables) that holds control-token text: it cannot be tokenized apart from
    the markup, so it could open a turn of its own."""
    for text in rendered.markup:
        if tokenize(text, special=True) != tokenize(text, special=False):
            raise TandemError("A tool definition, tool call or template variable contains control-token text "
                              "(such as <|im_end|>); remove it.")


def render_chat(
    messages: list[Message],
    template: str | None,
    *,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
    inputs: TemplateInputs = NO_INPUTS,
) -> RenderedChat:
    """``inputs``: the request's tools and template variables (:class:`TemplateInputs`)."""
    if not template:
        text = render_fallback(messages)
        return RenderedChat(text, list(FALLBACK_STOPS), has_bos=False, segments=((text, True),),
                            contents=(text,))

    def render(msgs: list[Message]) -> str:
        fixed = {"messages": msgs, "bos_token": bos_token, "eos_token": eos_token,
                 "add_generation_prompt": add_generation_prompt, "tools": inputs.tools}
        return _compiled(template).render({**inputs.variables, **fixed})

    nonce = secrets.token_hex(6)
    try:
        marked = render([{**m, "content": _placeholder(m.get("content", ""), i, nonce)} for i, m in enumerate(messages)])
        segments = split_content(marked, [m.get("content", "") for m in messages], nonce)
        text = "".join(p for p, _ in segments) if segments is not None else render(messages)
    except TemplateError as exc:
        raise TandemError(f"The model's chat template failed to render: {exc}") from None
    except Exception as exc:  # a template from a model file can fail in any way (TypeError, ...)
        raise TandemError(f"The model's chat template failed to render ({type(exc).__name__}: {exc}).") from None
    return RenderedChat(text, [], has_bos=bool(bos_token) and text.startswith(bos_token),
                        segments=None if segments is None else tuple(segments),
                        contents=tuple(m.get("content", "").strip() for m in messages),
                        markup=_markup(messages, inputs))


def _markup(messages: list[Message], inputs: TemplateInputs) -> tuple[str, ...]:
    texts = [json.dumps(t, ensure_ascii=False) for t in inputs.tools or ()]
    texts += [json.dumps(m["tool_calls"], ensure_ascii=False) for m in messages if m.get("tool_calls")]
    if inputs.variables:
        texts.append(json.dumps(dict(inputs.variables), ensure_ascii=False))
    return tuple(texts)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    """Templates' ``tojson`` as Hugging Face defines it (keys in their order, text not
    HTML-escaped); Jinja's own sorts keys and escapes ``<``, which models never saw."""
    return json.dumps(value, ensure_ascii=False, indent=indent)


@functools.lru_cache(maxsize=16)
def _compiled(template: str) -> Template:
    """A template compiled once (compiling costs tens of milliseconds; a chat renders on
    every reply). Compile errors are raised on each call, as before."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    return env.from_string(template)


def _placeholder(content: str, i: int, nonce: str) -> str:
    """A marker that keeps the content's outer whitespace, so a template that trims
    the content trims the marker's padding the same way. Empty content stays empty: a
    template may test it (an assistant turn that only called tools)."""
    if not content:
        return content
    core = content.strip()
    start = content.find(core) if core else len(content)
    return f"{content[:start]}\ue000{nonce}:{i}\ue001{content[start + len(core):]}"


def split_content(marked: str, contents: list[str], nonce: str) -> list[tuple[str, bool]] | None:
    """Cut a placeholder rendering into template and content pieces (content restored);
    ``None`` if the template mangled a placeholder (sliced, re-cased, ...)."""
    pattern = re.compile(f"\ue000{nonce}:(\\d+)\ue001")
    out: list[tuple[str, bool]] = []
    pos = 0
    for m in pattern.finditer(marked):
        i = int(m.group(1))
        if i >= len(contents):
            return None
        out.append((marked[pos:m.start()], False))
        out.append((contents[i].strip(), True))
        pos = m.end()
    out.append((marked[pos:], False))
    if any("\ue000" in piece or "\ue001" in piece for piece, is_content in out if not is_content):
        return None
    return [(p, c) for p, c in out if p or c]
