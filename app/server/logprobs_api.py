"""``logprobs`` / ``top_logprobs`` in OpenAI's two shapes (chat and legacy completions).

The numbers are the target model's log-probabilities for each generated token
(:mod:`tandem.runtime.logprobs`): computed from the target's logits at every committed
position, so they are the same with or without speculative decoding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tandem.app.server.api_error import ApiError
from tandem.runtime.logprobs import MAX_TOP, TokenLogprob, token_text

TokenBytes = Callable[[int], bytes]
MAX_LEGACY_TOP = 5
"""The legacy completions API allows ``logprobs`` up to 5."""


def _int_in(value: Any, key: str, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= hi:
        raise ApiError(400, f"'{key}' must be an integer in [0, {hi}], got {value!r}.", "invalid_value", key)
    return value


def parse_logprobs(body: dict, *, chat: bool) -> int | None:
    """How many alternatives per token the request wants (0: only the chosen token's
    log-probability), or ``None`` for no logprobs at all.

    Chat: ``logprobs`` is a boolean and ``top_logprobs`` (0-20) needs it. Completions:
    ``logprobs`` is the number of alternatives (0-5), ``null`` for none.
    """
    if not chat:
        value = body.get("logprobs")
        return None if value is None else _int_in(value, "logprobs", MAX_LEGACY_TOP)
    wanted = body.get("logprobs", False)
    if wanted is None:
        wanted = False
    if not isinstance(wanted, bool):
        raise ApiError(400, "'logprobs' must be true or false.", "invalid_value", "logprobs")
    top = body.get("top_logprobs")
    if top is not None:
        top = _int_in(top, "top_logprobs", MAX_TOP)
        if not wanted:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true.", "invalid_value", "top_logprobs")
    return (top or 0) if wanted else None


def _entry(token: int, logprob: float, token_bytes: TokenBytes) -> dict:
    text, raw = token_text(token_bytes, token)
    return {"token": text, "logprob": logprob, "bytes": raw}


def chat_logprobs(lps: Sequence[TokenLogprob], token_bytes: TokenBytes) -> dict:
    """``choice.logprobs`` of a chat completion (or of one streamed chunk)."""
    return {"content": [{**_entry(lp.token, lp.logprob, token_bytes),
                         "top_logprobs": [_entry(t.token, t.logprob, token_bytes) for t in lp.top]}
                        for lp in lps], "refusal": None}


def completion_logprobs(lps: Sequence[TokenLogprob], token_bytes: TokenBytes, offset: int = 0) -> dict:
    """``choice.logprobs`` of a legacy completion: parallel lists, offsets into the text."""
    tokens, offsets, top = [], [], []
    for lp in lps:
        text, _ = token_text(token_bytes, lp.token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        top.append({token_text(token_bytes, t.token)[0]: t.logprob for t in lp.top})
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps], "top_logprobs": top,
            "text_offset": offsets}


def shape(lps: Sequence[TokenLogprob], token_bytes: TokenBytes, *, chat: bool, offset: int = 0) -> dict:
    return chat_logprobs(lps, token_bytes) if chat else completion_logprobs(lps, token_bytes, offset)


def parse_n_probs(body: dict) -> int | None:
    """llama-server's ``n_probs`` (``/completion``): how many alternatives per token, or
    ``None`` (absent or 0: no probabilities in the reply)."""
    value = body.get("n_probs")
    return None if value is None or _int_in(value, "n_probs", MAX_TOP) == 0 else value


def llama_probabilities(lps: Sequence[TokenLogprob], token_bytes: TokenBytes) -> list[dict]:
    """llama-server's ``completion_probabilities``: per token its id, text, bytes and
    log-probability, with ``top_logprobs`` in the same shape."""
    def entry(token: int, logprob: float) -> dict:
        return {"id": token, **_entry(token, logprob, token_bytes)}

    return [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t.token, t.logprob) for t in lp.top]}
            for lp in lps]
