"""A chat engine: messages in, streamed reply out, one model shared by the TUI and the server.

It renders the model's chat template, keeps older turns' KV cache (the next turn's
prompt starts with the previous one, so only the new text is evaluated), drops the
oldest turns when a conversation outgrows the context, and serialises access to the
single KV cache with a lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.models.chat_template import NO_INPUTS, Message, TemplateInputs, prompt_ids, render_chat
from tandem.runtime.backends.protocol import Backend
from tandem.runtime.chat_fit import ChatFitter, FitCancelled
from tandem.runtime.constrained import Grammar
from tandem.runtime.constrained.strategy import constrained
from tandem.runtime.generate import Event, Strategy, autoregressive, generate


@runtime_checkable
class Closable(Protocol):
    """What holds resources to free: an engine's owner, a speculative strategy (its
    drafters); plain decoding is a bare function and holds none."""

    def close(self) -> None: ...


def chat_prompt(target: Backend, messages: Sequence[Message],
                inputs: TemplateInputs = NO_INPUTS) -> tuple[list[int], list[str]]:
    """Prompt ids for ``messages`` rendered with the target's chat template (ready for
    the assistant's reply), and the template's stop strings. ``inputs``: the request's
    tools and template variables."""
    special = target.special
    rendered = render_chat(
        list(messages), target.chat_template(), bos_token=special.bos_text, eos_token=special.eos_text, inputs=inputs
    )
    # message content is tokenized as text: typed control tokens cannot open a new turn
    ids = prompt_ids(rendered, target.tokenize, add_bos=not rendered.has_bos)
    return ids, rendered.stops


class ChatEngine:
    """Owns the target, the decoding strategy (kept across turns, so drafter caches and
    adaptive statistics persist) and the drafter backend if any; :meth:`close` frees all."""

    def __init__(
        self,
        target: Backend,
        strategy: Strategy | None = None,
        *,
        drafter: Backend | None = None,
        owner: Closable | None = None,
    ) -> None:
        self.target = target
        self.strategy = strategy or autoregressive
        self.drafter = drafter
        self.owner = owner
        """What opened target, strategy and drafter (:class:`tandem.runtime.engine.builder.Engine`):
        :meth:`close` closes it instead of them."""
        self.lock = threading.Lock()
        self.fitter = ChatFitter(target)
        """Renders and fits conversations; keeps every turn's tokens for the next reply."""
        self.fit_lock = threading.Lock()
        """Guards :attr:`fitter`'s caches: the server's parallel slots fit conversations
        at once, each under its own slot's lock."""

    def render(self, messages: Sequence[Message], inputs: TemplateInputs = NO_INPUTS) -> tuple[list[int], list[str]]:
        """Prompt ids for ``messages`` (ready for the assistant's reply) and stop strings."""
        with self.fit_lock:
            return self.fitter.prompt(messages, inputs)

    def fit(self, messages: Sequence[Message], max_tokens: int, *, cancel: threading.Event | None = None,
            keep_start: bool = False, inputs: TemplateInputs = NO_INPUTS) -> tuple[list[int], list[str]]:
        """Prompt ids and stop strings for ``messages``, leaving out the fewest oldest
        non-system turns so the prompt leaves room for the reply (:mod:`.chat_fit`: each
        turn is tokenized once for the engine's life). Raises :class:`FitCancelled` when
        ``cancel`` is set, :class:`PromptError` (saying how big) when nothing fits.

        ``keep_start`` (a chat that goes on turn after turn) leaves turns out in runs of
        half the room, so the prompt keeps its start, and its KV cache, from one reply to
        the next: a long chat then evaluates only its new turn. ``inputs``: the
        request's tools and template variables."""
        room = self.target.n_ctx - max(1, min(max_tokens, self.target.n_ctx // 2))
        with self.fit_lock:
            fitted = self.fitter.fit(messages, room, cancel=cancel, block=room // 2 if keep_start else 0,
                                     inputs=inputs)
        return fitted.ids, fitted.stops

    def stream(
        self,
        messages: Sequence[Message],
        params: SamplingParams,
        max_tokens: int = 512,
        stop: Sequence[str] = (),
        cancel: threading.Event | None = None,
        logprobs: int | None = None,
        reply_prefix: str = "",
        grammar: Grammar | None = None,
        keep_start: bool = False,
    ) -> Iterator[Event]:
        """Stream the assistant's reply to ``messages`` (the last one is the user's).

        ``reply_prefix`` is the start of that reply, already shown (one cut off earlier):
        the model writes on from its end, and the events carry only the new text.
        ``grammar`` (from :func:`~tandem.runtime.constrained.compile_grammar` on this
        engine's target) constrains the reply: every token legal, end only where the
        grammar is complete. Cancelled while the conversation is being fitted, it yields
        nothing."""
        strategy = self.strategy if grammar is None else constrained(self.strategy, grammar)
        with self.lock:
            try:
                ids, stops = self.fit(messages, max_tokens, cancel=cancel, keep_start=keep_start)
            except FitCancelled:
                return
            if reply_prefix:
                ids += self.target.tokenize(reply_prefix, add_bos=False)
            yield from generate(self.target, ids, Sampler(params), strategy=strategy, max_tokens=max_tokens,
                                stop=[*stops, *stop], cancel=cancel, logprobs=logprobs)

    def stats_memory(self) -> dict[str, int]:
        """Bytes in use: target weights, drafter weights, KV caches (both models). No
        ``drafter`` entry without a drafter model (model-free drafting holds no weights);
        0 for one that loads when first asked for a draft and has not been."""
        t = self.target.memory()
        if self.drafter is None:
            return {"target": t.weights, "kv": t.kv_cache, "total": t.total}
        d = self.drafter.memory()
        return {"target": t.weights, "drafter": d.weights, "kv": t.kv_cache + d.kv_cache, "total": t.total + d.total}

    def close(self) -> None:
        with self.lock:
            if self.owner is not None:
                self.owner.close()
                return
            if isinstance(self.strategy, Closable):
                self.strategy.close()
            for backend in (self.drafter, self.target):
                if backend is not None:
                    backend.close()
