"""Chat templates: the model's own Jinja template from GGUF metadata, or a plain fallback.

Templates run in Jinja's immutable sandbox (a model file is untrusted input) with the
variables Hugging Face templates expect: ``messages``, ``bos_token``, ``eos_token``,
``add_generation_prompt`` and ``raise_exception``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tandem.models.errors import TandemError

Message = dict[str, str]

FALLBACK_STOPS = ["\nUser:", "\nSystem:"]


@dataclass(frozen=True)
class RenderedChat:
    text: str
    stops: list[str]
    """Stop strings the template implies (the fallback's role markers)."""
    has_bos: bool
    """Whether ``text`` already begins with the BOS token text."""


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


def render_chat(
    messages: list[Message],
    template: str | None,
    *,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
) -> RenderedChat:
    if not template:
        return RenderedChat(render_fallback(messages), list(FALLBACK_STOPS), has_bos=False)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        text = env.from_string(template).render(
            messages=messages,
            bos_token=bos_token,
            eos_token=eos_token,
            add_generation_prompt=add_generation_prompt,
        )
    except TemplateError as exc:
        raise TandemError(f"The model's chat template failed to render: {exc}") from None
    return RenderedChat(text, [], has_bos=bool(bos_token) and text.startswith(bos_token))
