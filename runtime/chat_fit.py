"""Fitting a conversation to the context in time linear in its length.

A long chat outgrows the context: the oldest non-system turns are dropped until the
prompt leaves room for the reply. Dropping one turn at a time and tokenizing the whole
rendering after each drop costs turns x prompt; here each turn is tokenized once, its
tokens kept for the next replies (a turn's text does not change), and the cut is found
from those counts.

Why the cached pieces are exact: the template is rendered once with a placeholder per
message (:func:`tandem.models.chat_template.render_chat`), which cuts the prompt into
*chunks*, one per message: the template text before its content, then the content.
llama.cpp splits text at control tokens before it runs BPE, so when every chunk after
the first starts with a control token (``<|im_start|>``, ``<|im_end|>``: every ChatML
template), tokenizing chunk by chunk gives the very ids the whole prompt gives. Where a
template does not cut that way the whole kept prompt is tokenized as before, and the
chunk counts only guide the search for the cut.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tandem.errors import PromptError
from tandem.models.chat_template import (
    NO_INPUTS,
    Message,
    RenderedChat,
    TemplateInputs,
    check_markup,
    prompt_ids,
    render_chat,
)
from tandem.runtime.backends.protocol import Backend


class FitCancelled(Exception):
    """The request was cancelled while its conversation was being fitted."""


class TokenMemo:
    """Token ids of texts tokenized before, least recently used dropped first beyond
    ``max_chars`` characters of cached text. Not thread-safe: the chat engine's lock
    guards it."""

    def __init__(self, tokenize: Callable[..., list[int]], max_chars: int = 2_000_000) -> None:
        self._tokenize = tokenize
        self._max_chars = max_chars
        self._chars = 0
        self._ids: OrderedDict[tuple[str, bool, bool], list[int]] = OrderedDict()
        self.calls = 0
        """How many times the tokenizer itself ran (a miss)."""

    def __call__(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]:
        key = (text, add_bos, special)
        ids = self._ids.get(key)
        if ids is not None:
            self._ids.move_to_end(key)
            return ids
        self.calls += 1
        ids = self._tokenize(text, add_bos=add_bos, special=special)
        if len(text) <= self._max_chars // 4:
            self._ids[key] = ids
            self._chars += len(text)
            while self._chars > self._max_chars:
                (old, _, _), _ = self._ids.popitem(last=False)
                self._chars -= len(old)
        return ids


@dataclass(frozen=True)
class Fitted:
    ids: list[int]
    stops: list[str]
    dropped: int
    """How many of the oldest non-system messages were left out."""


class ChatFitter:
    """Renders and fits conversations for one target, caching every turn's tokens."""

    def __init__(self, target: Backend) -> None:
        self.target = target
        self.memo = TokenMemo(target.tokenize)
        self._starts_with_control: dict[str, bool] = {}
        self._has_control: dict[str, bool] = {}

    # -- rendering ------------------------------------------------------------------
    def render(self, messages: Sequence[Message], inputs: TemplateInputs = NO_INPUTS) -> RenderedChat:
        s = self.target.special
        return render_chat(list(messages), self.target.chat_template(), bos_token=s.bos_text, eos_token=s.eos_text,
                           inputs=inputs)

    def prompt(self, messages: Sequence[Message],
               inputs: TemplateInputs = NO_INPUTS) -> tuple[list[int], list[str]]:
        """Prompt ids for ``messages`` (ready for the reply) and the template's stop strings.
        ``inputs``: the request's tools and template variables."""
        rendered = self.render(messages, inputs)
        return self._ids(rendered, len(messages)), rendered.stops

    def _ids(self, rendered: RenderedChat, n_messages: int) -> list[int]:
        check_markup(rendered, self.memo)
        chunks = self._chunks(rendered, n_messages)
        if chunks is None:  # the whole text, as :func:`prompt_ids` always did
            return prompt_ids(rendered, self.memo, add_bos=not rendered.has_bos)
        add_bos = not rendered.has_bos
        per_chunk = [self._chunk_ids(piece, content, add_bos and i == 0) for i, (piece, content) in enumerate(chunks)]
        if any(self._control_text(piece, content, ids, add_bos and i == 0)
               for i, ((piece, content), ids) in enumerate(zip(chunks, per_chunk, strict=True))):
            # content with control-token text: every piece on its own, content as plain
            # text (what :func:`prompt_ids` does then)
            out: list[int] = []
            for i, (piece, content) in enumerate(chunks):
                if piece or (i == 0 and add_bos):
                    out += self.memo(piece, add_bos=add_bos and i == 0, special=True)
                if content:
                    out += self.memo(content, special=False)
            return out
        return [t for ids in per_chunk for t in ids]

    def _chunk_ids(self, piece: str, content: str, add_bos: bool) -> list[int]:
        """One message's chunk, tokenized once for the engine's life."""
        return self.memo(piece + content, add_bos=add_bos, special=True)

    def _chunks(self, rendered: RenderedChat, n_messages: int) -> list[tuple[str, str]] | None:
        """``rendered`` as (template text, content) per message plus the closing text
        (content ``""``), when tokenizing it chunk by chunk is exact; ``None`` otherwise."""
        segments = rendered.segments
        if segments is None or all(is_content for _, is_content in segments):
            return None
        chunks: list[tuple[str, str]] = []
        piece = ""
        for text, is_content in segments:
            if is_content:
                chunks.append((piece, text))
                piece = ""
            else:
                piece += text
        chunks.append((piece, ""))
        if len(chunks) != n_messages + 1:
            return None  # a message rendered twice or not at all
        for i in range(1, len(chunks)):
            piece, _ = chunks[i]
            before = chunks[i - 1][0] + chunks[i - 1][1]
            if not (piece and self._control_first(piece)) or (before and before[-1].isspace()):
                return None
        return chunks

    def _control_first(self, piece: str) -> bool:
        """Whether ``piece`` begins with a control token (one that contributes no bytes
        of text): llama.cpp cuts the text there before BPE, whatever comes before."""
        known = self._starts_with_control.get(piece)
        if known is None:
            ids = self.memo(piece, special=True)
            known = bool(ids) and self.target.token_bytes(ids[0]) == b""
            self._starts_with_control[piece] = known
        return known

    def _control_text(self, piece: str, content: str, chunk_ids: list[int], add_bos: bool) -> bool:
        """Whether ``content`` holds control-token text (``<|im_end|>`` typed by a user).
        Parsed with control tokens, such text becomes tokens without bytes: the chunk
        then has more of them than its template text alone."""
        known = self._has_control.get(content)
        if known is None:
            def controls(ids: list[int]) -> int:
                return sum(1 for t in ids if self.target.token_bytes(t) == b"")

            known = bool(content) and controls(chunk_ids) > controls(self.memo(piece, add_bos=add_bos, special=True))
            self._has_control[content] = known
        return known

    # -- fitting --------------------------------------------------------------------
    def fit(self, messages: Sequence[Message], room: int, *, cancel: threading.Event | None = None,
            block: int = 0, inputs: TemplateInputs = NO_INPUTS) -> Fitted:
        """The prompt for ``messages`` with the fewest oldest non-system messages left
        out so that it is at most ``room`` tokens (the last message is always kept).

        ``block`` > 0 leaves messages out in runs of about ``block`` tokens, counted from
        the start of the chat, so the kept prompt keeps its start (and its KV cache) from
        one reply to the next until a whole run has to go.
        """
        msgs = list(messages)
        droppable = [i for i, m in enumerate(msgs[:-1]) if m["role"] != "system"]
        costs = self._costs(msgs, cancel, inputs)
        total = sum(costs.values()) + 1

        def kept(k: int) -> list[Message]:
            gone = set(droppable[:k])
            return [m for i, m in enumerate(msgs) if i not in gone]

        lengths: dict[int, tuple[list[int], list[str]]] = {}

        def exact(k: int) -> tuple[list[int], list[str]]:
            if k not in lengths:
                if cancel is not None and cancel.is_set():
                    raise FitCancelled
                lengths[k] = self.prompt(kept(k), inputs)
            return lengths[k]

        def fits(k: int) -> bool:
            return len(exact(k)[0]) <= room

        # the estimate: each message's chunk counted once, left out from the oldest
        est = total
        guess = 0
        while guess < len(droppable) and est > room:
            est -= costs[droppable[guess]]
            guess += 1
        last = len(droppable)
        k = _first_fitting(fits, guess, last)
        if k is None:
            raise PromptError(too_big(len(msgs), last, total, len(exact(last)[0]), room, self.target.n_ctx))
        if block > 0 and k > 0:
            k = _block_end(k, [costs[i] for i in droppable], block)
        ids, stops = exact(k)
        return Fitted(list(ids), stops, k)

    def _costs(self, msgs: list[Message], cancel: threading.Event | None,
               inputs: TemplateInputs = NO_INPUTS) -> dict[int, int]:
        """Tokens per message (its chunk of the whole rendering), each chunk tokenized
        once for the life of the engine."""
        rendered = self.render(msgs, inputs)
        chunks = self._chunks(rendered, len(msgs))
        out = {}
        for i, m in enumerate(msgs):
            if cancel is not None and i % 64 == 0 and cancel.is_set():
                raise FitCancelled
            if chunks is None:  # a guide only: the role and the content
                out[i] = len(self.memo(f"{m['role']}\n{m.get('content', '')}", special=True))
            else:
                out[i] = len(self._chunk_ids(*chunks[i], i == 0 and not rendered.has_bos))
        if chunks is not None:
            out[len(msgs)] = len(self._chunk_ids(*chunks[-1], False))
        return out


def _first_fitting(fits: Callable[[int], bool], guess: int, last: int) -> int | None:
    """The smallest k in [0, last] with ``fits(k)``, ``None`` if none: searched from
    ``guess`` in growing steps, then halving (fitting is monotone: leaving more out never
    makes the prompt longer)."""
    guess = min(max(guess, 0), last)
    step = 1
    if fits(guess):
        lo, hi = -1, guess
        while hi > 0:
            probe = max(hi - step, 0)
            if not fits(probe):
                lo = probe
                break
            hi, step = probe, step * 2
        if hi == 0:
            return 0
    else:
        lo = guess
        while True:
            if lo == last:
                return None
            probe = min(lo + step, last)
            if fits(probe):
                hi = probe
                break
            lo, step = probe, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi


def _block_end(k: int, costs: list[int], block: int) -> int:
    """The first run boundary at or after ``k``: messages are left out in runs of about
    ``block`` tokens counted from the chat's start (a boundary is where the running total
    passes a multiple of ``block``), so the cut stays put while the chat grows."""
    total = sum(costs[:k])
    for j in range(k, len(costs)):
        if j > 0 and total // block != (total - costs[j - 1]) // block:
            return j
        total += costs[j]
    return len(costs)


def too_big(messages: int, droppable: int, total: int, kept: int, room: int, n_ctx: int) -> str:
    """Why a conversation cannot fit, however many turns are left out: ``kept`` tokens
    remain with every ``droppable`` message out (``total``: the whole one, estimated)."""
    limit = f"with room for the reply the context ({n_ctx}) holds {room}. Shorten it or raise the context size."
    if droppable == 0:  # nothing could be left out: the conversation is what it is
        what = "The message is" if messages == 1 else f"The conversation ({messages} messages) is"
        return f"{what} {kept} tokens, and {limit}"
    rest = ("its last message and the system prompt alone come" if messages > droppable + 1
            else "its last message alone comes")
    return (f"The conversation is about {max(total, kept)} tokens in {messages} messages; even {rest} to {kept} "
            f"tokens, and {limit}")

