"""llama-server's native ``/completion``: a prompt in, ``{"content", "stop": true, ...}``
out, streamed as ``{"content", "stop": false}`` events; it takes llama-server's
``grammar`` and ``json_schema`` fields (and ``response_format``) like the OpenAI routes.

Only the JSON shapes live here; generation is the OpenAI ``/v1/completions`` job.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from tandem.app.server.openai import GenRequest
from tandem.app.server.streams import OpenStreams, ReplyStream, StreamConfig, llama_server_stream
from tandem.app.server.worker import Job
from tandem.runtime.generate import DoneEvent, TokenEvent


def stop_type(reason: str) -> str:
    """llama-server's ``stop_type`` for a finish reason."""
    return {"length": "limit", "stop": "eos"}.get(reason, "none")


def done_body(done: DoneEvent, req: GenRequest, model: str) -> dict[str, Any]:
    st = done.stats
    return {"index": 0, "content": done.text, "id_slot": 0, "stop": True, "model": model,
            "tokens_predicted": st.generated_tokens, "tokens_evaluated": st.prompt_tokens,
            "stop_type": stop_type(st.finish_reason), "stopping_word": "",
            "generation_settings": {"n_predict": req.max_tokens, "temperature": req.params.temperature,
                                    "seed": req.params.seed, "stop": req.stop},
            "timings": {"predicted_n": st.generated_tokens, "predicted_ms": st.total_s * 1000,
                        "predicted_per_second": st.tokens_per_s},
            "tandem": {"stats": st.as_dict()}}


def completion_stream(first: Any, items: AsyncIterator, job: Job, *, req: GenRequest, model: str,
                      config: StreamConfig, streams: OpenStreams) -> ReplyStream:
    return llama_server_stream(
        first, items, job,
        chunk=lambda ev: ({"index": 0, "content": ev.text, "stop": False}
                          if isinstance(ev, TokenEvent) and ev.text else None),
        final=lambda ev: done_body(ev, req, model) | {"content": ""} if isinstance(ev, DoneEvent) else None,
        unfinished=lambda _: {"content": "", "stop": True, "stop_type": "none", "model": model},
        config=config, streams=streams)
