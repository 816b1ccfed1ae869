"""``logit_bias`` as OpenAI and llama-server send it.

OpenAI: ``{"<token id>": value}``, values from -100 (the token practically banned) to 100
(practically forced). llama-server also takes a list of ``[token id, value]`` pairs, and
``false`` as the value bans the token outright. What comes out is the runtime's form,
(token id, value) pairs, applied by the sampler at every position of the target, so
speculative decoding stays lossless under a bias; the ids are checked against the model's
vocabulary once the request's model is known (:func:`.openai.check_token_ids`).
"""

from __future__ import annotations

import math
from typing import Any

from tandem.app.server.api_error import ApiError

MAX_ENTRIES = 1024
"""More than any client sends (OpenAI allows 300), few enough to cost nothing per token."""


def parse_logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    raw = body.get("logit_bias")
    if raw is None:
        return ()
    if isinstance(raw, dict):
        pairs: list[Any] = list(raw.items())
    elif isinstance(raw, list) and all(isinstance(p, list) and len(p) == 2 for p in raw):
        pairs = raw
    else:
        raise _bad("must be an object of token ids to values, or a list of [token id, value] pairs")
    if len(pairs) > MAX_ENTRIES:
        raise _bad(f"holds {len(pairs)} entries; at most {MAX_ENTRIES}")
    return tuple((_token(key), _value(key, value)) for key, value in pairs)


def _token(key: Any) -> int:
    if isinstance(key, str) and key.isascii() and key.isdigit():
        return int(key)
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return key
    raise _bad(f"names {key!r}; a token id is a whole number (see /tokenize for a text's ids)")


def _value(key: Any, value: Any) -> float:
    if value is False:  # llama-server: the token is never chosen
        return -math.inf
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad(f"gives token {key} the value {value!r}; a value is a number (or false to ban it)")
    return float(value)


def _bad(what: str) -> ApiError:
    return ApiError(400, f"'logit_bias' {what}.", "invalid_value", "logit_bias")
