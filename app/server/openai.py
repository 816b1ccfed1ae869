"""Request parsing and response shapes of the OpenAI-compatible API (and llama.cpp /infill).

Parsing is strict where a wrong value would silently change behaviour (types, ranges)
and lenient where clients differ harmlessly (unknown fields are ignored, ``model`` may
be omitted when only one model is served). Every problem becomes an
:class:`~.api_error.ApiError`, which the app turns into a JSON error body with a 4xx status.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from tandem.app.server.api_error import ApiError
from tandem.app.server.logit_bias import parse_logit_bias
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.generate import NO_LIMIT

MAX_N = 8
"""Most drafts one request may ask for (superposed decoding keeps k small by design)."""

MAX_DEPTH = 32
"""Deepest JSON nesting a request may use (real requests need about 5)."""


def parse_json(raw: bytes, max_bytes: int) -> dict:
    """The request body as a dict whose every string is valid Unicode.

    ``json.loads`` accepts things the rest of the server cannot handle: lone UTF-16
    surrogates (``"\\ud800"``) that fail later when encoded, nesting deep enough to hit
    the recursion limit, and integer literals past Python's digit limit. Each becomes a
    400 here instead of a 500 somewhere downstream.
    """
    if len(raw) > max_bytes:
        raise ApiError(413, f"Request body is {len(raw)} bytes; the limit is {max_bytes}.", "request_too_large")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"The request body is not valid JSON ({exc}).", "invalid_json") from None
    except RecursionError:
        raise ApiError(400, f"The request body nests deeper than {MAX_DEPTH} levels.", "invalid_json") from None
    except ValueError as exc:  # e.g. an integer literal with more digits than Python converts
        raise ApiError(400, f"The request body holds a value out of range ({exc}).", "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.", "invalid_json")
    check_tree(body)
    return body


def check_tree(body: Any) -> None:
    """Reject nesting deeper than :data:`MAX_DEPTH` and strings that are not valid
    Unicode (lone surrogates); iterative, so a hostile body cannot exhaust the stack."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ApiError(400, f"The request body nests deeper than {MAX_DEPTH} levels.", "invalid_json")
        if isinstance(node, dict):
            for k, v in node.items():
                _check_text(k)
                stack.append((v, depth + 1))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
        elif isinstance(node, str):
            _check_text(node)


def _check_text(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, "The request holds a string that is not valid Unicode (a lone surrogate escape "
                       "such as \\ud800).", "invalid_text") from None


def _num(body: dict, key: str, default: float | None, lo: float, hi: float, *, integer: bool = False) -> Any:
    v = body.get(key, default)
    if v is None:
        return default
    ok = isinstance(v, int) if integer else isinstance(v, int | float)
    if isinstance(v, bool) or not ok or not lo <= v <= hi:
        kind = "an integer" if integer else "a number"
        raise ApiError(400, f"'{key}' must be {kind} in [{lo}, {hi}], got {v!r}.", "invalid_value", key)
    return v


def _asks_nothing(body: dict, key: str, off: tuple[Any, ...]) -> bool:
    """``body[key]`` is absent or one of the values ``off`` (of the same kind: ``false``
    is no ``0``); ``best_of`` equal to ``n`` asks for nothing either."""
    value = body.get(key)
    if value is None or (key == "best_of" and value == body.get("n", 1)):
        return True
    return isinstance(value, bool) == isinstance(off[0], bool) and value in off


def flag(body: dict, key: str, default: bool = False) -> bool:
    """A true/false field (``default`` when absent), or a 400 naming it."""
    v = body.get(key, default)
    if not isinstance(v, bool):
        raise ApiError(400, f"'{key}' must be true or false.", "invalid_value", key)
    return v


def _named(body: dict, *keys: str) -> str:
    """The key a request uses for a setting with several names (vLLM's, llama-server's)."""
    return next((k for k in keys if k in body), keys[0])


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and len(stop) <= 16 and all(isinstance(s, str) for s in stop):
        return [s for s in stop if s]
    raise ApiError(400, "'stop' must be a string or a list of at most 16 strings.", "invalid_value", "stop")


REPLY_ROOM = 256
"""Tokens a chat without a token limit is fitted to leave for the reply."""


@dataclass
class GenRequest:
    """What every generation endpoint needs, already validated."""

    model: str | None
    max_tokens: int
    """The most tokens the reply may run (:data:`NO_LIMIT`: until the model ends it or the
    context is full)."""
    params: SamplingParams
    stop: list[str]
    n: int
    stream: bool
    include_usage: bool = False
    ignore_eos: bool = False
    """llama-server's ``ignore_eos``: generate past end-of-generation tokens, to ``max_tokens``."""
    logprobs: int | None = None
    """Alternatives per token for ``logprobs`` (0: only the chosen token's), ``None``: off."""
    grammar: Any = None
    """The runtime's compiled grammar the reply must follow (``None``: free text); see
    :mod:`.output_format`."""
    template_variables: dict[str, Any] = field(default_factory=dict)
    """A chat request's ``chat_template_kwargs`` (:func:`.chat_messages.parse_template_variables`)."""
    prediction: str | None = None
    """OpenAI's Predicted Outputs: text the reply is expected to be, mostly (:func:`parse_prediction`)."""

    @property
    def reply_room(self) -> int:
        """Tokens a chat is fitted to leave free for the reply: its limit, or without one
        :data:`REPLY_ROOM` (reserving half the context for a reply that may be short would
        leave out half the chat)."""
        return REPLY_ROOM if self.max_tokens == NO_LIMIT else self.max_tokens

    @property
    def n_predict(self) -> int:
        """The limit as llama-server reports it (-1: none)."""
        return -1 if self.max_tokens == NO_LIMIT else self.max_tokens


UNSUPPORTED_UNLESS: dict[str, tuple[Any, ...]] = {
    "echo": (False,), "best_of": (1,),  # legacy completions
    # llama-server's other samplers, at the values that turn them off
    "mirostat": (0,), "typical_p": (1, 1.0), "tfs_z": (1, 1.0), "dry_multiplier": (0, 0.0),
    "xtc_probability": (0, 0.0), "top_n_sigma": (-1, -1.0), "dynatemp_range": (0, 0.0),
    "post_sampling_probs": (False,), "lora": ([],),  # probabilities after sampling; LoRA adapters (none loaded)
}
"""Fields this server does not implement, with the values that ask for nothing; any other
value is a 400 naming the field, never silently ignored (the reply would not be what the
client asked for)."""


def refuse_unsupported(body: dict) -> None:
    """A 400 naming the first field that asks for what this server does not do."""
    for key, off in UNSUPPORTED_UNLESS.items():
        if not _asks_nothing(body, key, off):
            raise ApiError(400, f"'{key}' is not supported by this server (leave it out, or {off[0]!r}).",
                           "unsupported_parameter", key)
    for key in ("functions", "function_call"):  # OpenAI's legacy function calling
        if body.get(key) not in (None, [], "none"):
            raise ApiError(400, f"'{key}' is OpenAI's legacy form of function calling; send 'tools' (each "
                           "{\"type\": \"function\", \"function\": {...}}) and 'tool_choice' instead.",
                           "unsupported_parameter", key)
    if body.get("web_search_options") is not None:
        raise ApiError(400, "This server has no web search: 'web_search_options' is not supported.",
                       "unsupported_parameter", "web_search_options")
    modalities = body.get("modalities")
    if body.get("audio") or (isinstance(modalities, list) and any(m != "text" for m in modalities)):
        raise ApiError(400, "This server writes text only: 'modalities' other than \"text\" and 'audio' are not "
                       "supported.", "unsupported_parameter", "audio" if body.get("audio") else "modalities")


def parse_model(body: dict) -> str | None:
    """The model a request names (``None``: the one served), or a 400."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "'model' must be a string.", "invalid_value", "model")
    return model


def parse_common(body: dict, *, max_tokens_default: int = NO_LIMIT, max_tokens_key: str = "max_tokens") -> GenRequest:
    """The fields every generation endpoint shares. Without a token limit (or with -1, as
    llama-server's ``n_predict`` and Ollama's ``num_predict`` say it), a reply runs until
    the model ends it or the context is full, as OpenAI's do: ``max_tokens_default`` is
    for the endpoints whose API has its own (legacy completions 16, ``/infill``)."""
    refuse_unsupported(body)
    model = parse_model(body)
    max_tokens = _num(body, max_tokens_key, None, -1, NO_LIMIT, integer=True)
    if max_tokens is None:
        max_tokens = _num(body, "max_completion_tokens", max_tokens_default, -1, NO_LIMIT, integer=True)
    if max_tokens < 0:
        max_tokens = NO_LIMIT
    stream = flag(body, "stream")
    opts = body.get("stream_options") or {}
    seed = _num(body, "seed", None, -(2**63), 2**63 - 1, integer=True)
    params = SamplingParams(
        temperature=float(_num(body, "temperature", 1.0, 0.0, 2.0)),
        top_p=float(_num(body, "top_p", 1.0, 0.0, 1.0)),
        top_k=int(_num(body, "top_k", 40, 0, 1 << 20, integer=True)),
        min_p=float(_num(body, "min_p", 0.05, 0.0, 1.0)),
        repetition_penalty=float(_num(body, _named(body, "repetition_penalty", "repeat_penalty"), 1.0, 0.0, 10.0)),
        repeat_last_n=max(0, int(_num(body, "repeat_last_n", 64, -1, 1 << 20, integer=True))),
        presence_penalty=float(_num(body, "presence_penalty", 0.0, -2.0, 2.0)),
        frequency_penalty=float(_num(body, "frequency_penalty", 0.0, -2.0, 2.0)),
        logit_bias=parse_logit_bias(body),
        seed=None if seed is None else abs(seed),
    )
    n = int(_num(body, "n", 1, 1, MAX_N, integer=True))
    ignore_eos = flag(body, "ignore_eos")
    if ignore_eos and n > 1:  # the n drafts stop where the model ends them
        raise ApiError(400, "'ignore_eos' is not available with n > 1.", "unsupported_parameter", "ignore_eos")
    return GenRequest(
        model=model, max_tokens=int(max_tokens), params=params, stop=_stops(body), n=n, stream=stream,
        include_usage=bool(isinstance(opts, dict) and opts.get("include_usage")), ignore_eos=ignore_eos,
    )


def parse_prediction(body: dict, n: int) -> str | None:
    """OpenAI's ``prediction`` (``{"type": "content", "content": text or text parts}``):
    the text the reply is expected to repeat, mostly (a file sent back with an edit). It
    is drafted from, so it changes how fast the reply comes, never what it says
    (:mod:`tandem.runtime.speculative.drafters.prediction`). As OpenAI, not with n > 1."""
    prediction = body.get("prediction")
    if prediction is None:
        return None
    content = prediction.get("content") if isinstance(prediction, dict) and prediction.get("type") == "content" else None
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(400, "'prediction' must be {\"type\": \"content\", \"content\": text} (or a list of "
                       "{\"type\": \"text\", \"text\": ...} parts).", "invalid_value", "prediction")
    if n > 1:
        raise ApiError(400, "'prediction' is not available with n > 1.", "unsupported_parameter", "prediction")
    return content or None


@dataclass(frozen=True)
class PredictionUse:
    """How much of a request's ``prediction`` the reply used (OpenAI's
    ``completion_tokens_details``): its tokens that appeared in the reply, and the rest."""

    accepted: int
    rejected: int


def parse_prompt(body: dict) -> str | list[int]:
    """The one prompt of a completion request: text, or token ids (OpenAI and llama-server
    take both), alone or as a list's only item. Token ids are used as given (no BOS added)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise ApiError(400, "'prompt' must be a string or a list of token ids (one prompt per request).",
                   "invalid_value", "prompt")


def check_drafts(req: GenRequest) -> None:
    """``n`` > 1 at temperature 0: the n choices come from one superposed decode, which
    reads the model's own distribution, so a penalty or a bias is a 400, never ignored."""
    p = req.params
    if req.n == 1 or not p.greedy:
        return
    for key, on in (("repetition_penalty", p.repetition_penalty != 1.0), ("presence_penalty", p.presence_penalty != 0),
                    ("frequency_penalty", p.frequency_penalty != 0), ("logit_bias", bool(p.logit_bias))):
        if on:
            raise ApiError(400, f"'{key}' is not available with n > 1 at temperature 0 (the n drafts come from one "
                           "superposed decode); send n 1, or a temperature.", "unsupported_parameter", key)


def check_token_ids(tokens: list, n_vocab: int, key: str) -> list[int]:
    """``tokens`` if each is a token id of a vocabulary of ``n_vocab``, else a 400 naming ``key``."""
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < n_vocab:
            raise ApiError(400, f"{key}[{i}] is {t!r}; a token id is a whole number from 0 to {n_vocab - 1}.",
                           "invalid_value", key)
    return tokens


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def new_call_id() -> str:
    """A tool call's id, in OpenAI's form."""
    return f"call_{uuid.uuid4().hex[:24]}"


def finish_reason(reason: str) -> str:
    return "length" if reason == "length" else "stop"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None,
          prediction: PredictionUse | None = None) -> dict[str, Any]:
    """OpenAI's ``usage``; ``cached_tokens``: prompt tokens whose KV was reused (only ever
    the same client's, see ``cache_owner``); ``prediction``: what the reply used of the
    request's prediction."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    if prediction is not None:
        out["completion_tokens_details"] = {"accepted_prediction_tokens": prediction.accepted,
                                            "rejected_prediction_tokens": prediction.rejected}
    return out


@dataclass
class Shaper:
    """Builds response objects for one request, with a fixed id and timestamp."""

    model: str
    chat: bool
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or new_id("chatcmpl" if self.chat else "cmpl")

    def _choice(self, index: int, text: str | None, reason: str | None, *, delta: bool, first: bool = False) -> dict:
        if self.chat:
            if delta:
                d: dict[str, str] = {"role": "assistant"} if first else {}
                if text is not None:
                    d["content"] = text
                return {"index": index, "delta": d, "finish_reason": reason}
            return {"index": index, "message": {"role": "assistant", "content": text or ""}, "finish_reason": reason}
        return {"index": index, "text": text or "", "logprobs": None, "finish_reason": reason}

    def chunk(self, index: int, text: str | None, reason: str | None = None, *, first: bool = False) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model,
                "choices": [self._choice(index, text, reason, delta=True, first=first)]}

    def reply_chunk(self, index: int, delta: Any) -> dict:
        """A chat chunk for a piece of a reply that may call tools: content text, or a
        :class:`~tandem.app.server.tool_calls.CallDelta` (OpenAI's ``tool_calls`` delta)."""
        if isinstance(delta, str):
            return self.chunk(index, delta)
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": index, "delta": {"tool_calls": [delta.shape()]}, "finish_reason": None}]}

    def usage_chunk(self, use: dict[str, Any]) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [], "usage": use}

    def full(self, texts: list[tuple[str, str]], use: dict[str, Any], extra: dict | None = None) -> dict:
        out = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
               "created": self.created, "model": self.model,
               "choices": [self._choice(i, t, r, delta=False) for i, (t, r) in enumerate(texts)], "usage": use}
        if extra:
            out.update(extra)
        return out
