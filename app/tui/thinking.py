"""Reasoning blocks: split a reply's ``<think>…</think>`` from its answer.

Reasoning models (Qwen3, DeepSeek-R1 and their distills) write their chain of thought
between ``<think>`` and ``</think>`` before the answer; some chat templates put the
opening tag in the prompt, so the reply holds only the closing one. The chat shows the
thinking collapsed above the answer, and the answer alone as Markdown.
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Split:
    thinking: str | None
    """The reasoning text, ``None`` when the reply has no think block."""
    answer: str
    done: bool
    """The think block is closed (always true without one)."""


def split_thinking(content: str) -> Split:
    """Split ``content`` into thinking and answer; works on partial (streaming) text.

    A reply that so far is only the start of ``<think>`` counts as thinking that has not
    started yet, so the tag's first characters never flash up as the answer.
    """
    head = content.lstrip()
    if head.startswith(OPEN):
        body = head[len(OPEN):]
        end = body.find(CLOSE)
        if end < 0:
            return Split(body.strip("\n"), "", False)
        return Split(body[:end].strip("\n"), body[end + len(CLOSE):].lstrip("\n"), True)
    if head and OPEN.startswith(head):
        return Split("", "", False)
    end = content.find(CLOSE)
    if end >= 0 and OPEN not in content[:end]:  # the template opened the block in the prompt
        return Split(content[:end].strip("\n"), content[end + len(CLOSE):].lstrip("\n"), True)
    return Split(None, content, True)


def thinking_title(split: Split) -> str:
    """The collapsible's title: how much thinking it holds, and the key that opens it."""
    words = len((split.thinking or "").split())
    return f"{'Thought' if split.done else 'Thinking…'} ({words} words) · F3 shows/hides"
