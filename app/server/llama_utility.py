"""llama-server's endpoints that generate nothing: ``/tokenize``, ``/detokenize``,
``/apply-template`` and ``/props``.

Clients written for llama-server call them to count a prompt's tokens before sending it
(SillyTavern, agent frameworks trimming their history), to see the prompt a chat turns
into, and to learn the context size, the slots and the chat template (llama.cpp's web
UI, SillyTavern). They answer at once, beside generation: tokenizing reads the
vocabulary only, never a KV cache, so they neither queue behind a reply nor touch a
slot. Shapes are llama-server's; what differs is said where it does.
"""

from __future__ import annotations

from typing import Any

from tandem.app.server.api_error import ApiError
from tandem.app.server.chat_messages import parse_messages, parse_template_variables
from tandem.app.server.loaded_models import ModelSlot
from tandem.app.server.openai import check_token_ids, flag, parse_common
from tandem.app.server.tools import for_template, parse_tools
from tandem.runtime.machine import tandem_version
from tandem.runtime.streaming_text import tokens_text


def _text(body: dict, key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str):
        raise ApiError(400, f"'{key}' must be a string.", "invalid_value", key)
    return value


def _piece(raw: bytes) -> str | list[int]:
    """A token's text, or its bytes where they are not whole UTF-8 characters (part of an
    emoji, say), as llama-server writes them."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def tokenize(slot: ModelSlot, body: dict) -> dict:
    """``content`` to token ids: with ``add_special``, the BOS token the model's prompts
    start with; with ``parse_special`` (the default, as in llama-server), control-token
    text such as ``<|im_start|>`` as that token; with ``with_pieces``, each id with its
    text."""
    content = _text(body, "content")
    ids = slot.target.tokenize(content, add_bos=flag(body, "add_special"), special=flag(body, "parse_special", True))
    if not flag(body, "with_pieces"):
        return {"tokens": ids}
    return {"tokens": [{"id": t, "piece": _piece(slot.target.token_bytes(t))} for t in ids]}


def detokenize(slot: ModelSlot, body: dict) -> dict:
    """``tokens`` to text, as a reply writes them: control tokens (BOS, end of turn) add no
    text (llama-server writes their names)."""
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise ApiError(400, "'tokens' must be a list of token ids.", "invalid_value", "tokens")
    return {"content": tokens_text(slot.target.token_bytes, check_token_ids(tokens, slot.target.n_vocab, "tokens"))}


def apply_template(slot: ModelSlot, body: dict) -> dict:
    """The prompt a chat request's ``messages`` (and ``tools``, ``chat_template_kwargs``) become: the text
    ``/v1/chat/completions`` tokenizes before the model writes its reply."""
    messages = parse_messages(body)
    tools = parse_tools(body)
    msgs, inputs = for_template(slot.target.chat_template(), messages, tools.offered if tools else (),
                                parse_template_variables(body))
    return {"prompt": slot.engine.fitter.render(msgs, inputs).text}


def props(slot: ModelSlot) -> dict:
    """The model's context and slots, the defaults a request gets, its chat template and
    special tokens. ``model_path`` is the file the server opened."""
    defaults = parse_common({})  # what a request that sets nothing gets
    p = defaults.params
    special = slot.target.special
    model_file = slot.target.compute_settings().model_file
    params: dict[str, Any] = {
        "n_predict": defaults.n_predict, "temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p,
        "min_p": p.min_p, "repeat_penalty": p.repetition_penalty, "repeat_last_n": p.repeat_last_n,
        "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
        "speculative": slot.speculative,
    }
    return {
        "default_generation_settings": {"n_ctx": slot.target.n_ctx, "params": params},
        "total_slots": len(slot.lanes),
        "model_alias": slot.name,
        "model_path": str(model_file) if model_file is not None else slot.name,
        "chat_template": slot.target.chat_template() or "",
        "bos_token": special.bos_text,
        "eos_token": special.eos_text,
        "modalities": {"vision": False, "audio": False},
        "build_info": f"tandem {tandem_version()}",
    }
