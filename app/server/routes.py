"""The generation routes: ``/v1/chat/completions``, ``/v1/completions`` and ``/infill``.

Requests wait in their model's queue (:mod:`.worker`: /infill first, a superseded
/infill cancelled, then arrival order over the model's parallel slots); :mod:`.queued`
takes a job from submission to its answer (its first item, so a prompt that does not fit
still gets a 4xx on a streaming request; a client's disconnect cancels it). Each job is tagged with its client (peer address plus
``Authorization``), so a cached prompt prefix serves only the client that left it
(:mod:`.cache_owner`).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from tandem.app.server import infill_api, jobs, llama_completion, queued
from tandem.app.server.api_error import ApiError
from tandem.app.server.cache_owner import client_identity
from tandem.app.server.chat_messages import parse_messages, parse_template_variables
from tandem.app.server.loaded_models import ModelSlot
from tandem.app.server.logprobs_api import llama_probabilities, parse_logprobs, parse_n_probs, shape
from tandem.app.server.openai import (
    GenRequest,
    Shaper,
    check_drafts,
    check_token_ids,
    finish_reason,
    flag,
    parse_common,
    parse_json,
    parse_prediction,
    parse_prompt,
    usage,
)
from tandem.app.server.output_format import OutputFormat, compile_format, parse_output_format
from tandem.app.server.streams import (
    OpenStreams,
    StreamConfig,
    drafts_stream,
    generation_stream,
    infill_stream,
)
from tandem.app.server.tool_calls import ToolCallParser, parse_reply
from tandem.app.server.tool_jobs import tool_chat_job
from tandem.app.server.tools import ToolRequest, call_schema, parse_tools
from tandem.app.server.worker import INFILL
from tandem.runtime.autocomplete.infill import InfillDone
from tandem.runtime.streaming_text import tokens_text


@dataclass
class Routes:
    slots: dict[str, ModelSlot]
    max_body_bytes: int
    stream_config: StreamConfig
    streams: OpenStreams = field(default_factory=OpenStreams)
    cache_reuse: int = 0
    """``/infill``: reuse cached runs of at least this many tokens that moved (0: off)."""

    # -- helpers --------------------------------------------------------------------
    def slot(self, name: str | None) -> ModelSlot:
        if name is None or (name not in self.slots and len(self.slots) == 1 and name in ("", "default")):
            if len(self.slots) == 1:
                return next(iter(self.slots.values()))
            raise ApiError(400, "Say which model with 'model'.", "model_required", "model")
        slot = self.slots.get(name)
        if slot is None:
            raise ApiError(404, f"The model '{name}' does not exist; GET /v1/models lists the served models.",
                           "model_not_found", "model")
        return slot

    def model_for(self, req: GenRequest) -> ModelSlot:
        """The model ``req`` names, once its settings are checked against that model's
        vocabulary (``logit_bias``) and its ``n`` (:func:`check_drafts`)."""
        slot = self.slot(req.model)
        check_token_ids([t for t, _ in req.params.logit_bias], slot.target.n_vocab, "logit_bias")
        check_drafts(req)
        return slot

    async def body(self, request: Request) -> dict:
        try:
            raw = await request.body()
        except ClientDisconnect:  # the body broke off (a bad chunk, a closed socket): nobody to answer
            raise ApiError(400, "The request body ended before it was complete.", "incomplete_body") from None
        if len(raw) < 65536:
            return parse_json(raw, self.max_body_bytes)
        # a big body takes milliseconds to parse: not on the loop other clients share
        return await asyncio.to_thread(parse_json, raw, self.max_body_bytes)

    async def prompt_ids(self, slot: ModelSlot, prompt: str | list[int]) -> list[int]:
        """A completion prompt's ids: text tokenized with BOS and with control-token text as
        those tokens (as llama-server and vLLM read it: a client that writes its own chat
        markup means it; a long prompt takes seconds, so never on the event loop), ids
        checked against the vocabulary."""
        if isinstance(prompt, str):
            return await asyncio.to_thread(slot.target.tokenize, prompt, add_bos=True, special=True)
        return check_token_ids(prompt, slot.target.n_vocab, "prompt")

    def check_fits(self, slot: ModelSlot, ids: list[int]) -> None:
        if len(ids) >= slot.target.n_ctx:
            raise ApiError(400, f"The prompt is {len(ids)} tokens; this model's context holds {slot.target.n_ctx}.",
                           "context_length_exceeded", "prompt")

    # -- routes ---------------------------------------------------------------------
    async def chat(self, request: Request):
        body = await self.body(request)
        req = parse_common(body)
        req.logprobs = _logprobs(body, req, chat=True)
        messages = parse_messages(body)
        req.template_variables = parse_template_variables(body)
        req.prediction = parse_prediction(body, req.n)
        fmt = parse_output_format(body, chat=True)
        tool_req = parse_tools(body)
        if tool_req is not None and tool_req.offered and fmt is not None:
            raise ApiError(400, f"'{fmt.field}' cannot be combined with 'tools' (the reply is either a call or "
                           "text in that format); send one, or tool_choice \"none\".", "invalid_value", fmt.field)
        slot = self.model_for(req)
        request.state.model = slot.name
        client = _client(request)
        req.grammar = await _compiled(slot, fmt, req)
        if tool_req is not None:
            if req.n > 1 or req.logprobs is not None:
                raise ApiError(400, "'tools' is not available with n > 1 or 'logprobs'.", "invalid_value", "tools")
            call = (OutputFormat("json_schema", call_schema(tool_req.offered), "tools", strict=False)
                    if tool_req.offered else None)
            call_grammar = await _compiled(slot, call, req)
            used = jobs.JobUsage()
            return await self.generation(
                request, slot, req, Shaper(slot.name, chat=True),
                tool_chat_job(slot, messages, req, tool_req, call_grammar, client, used), used, tools=tool_req,
                client=client, hint=_chat_hint(body, messages))
        if req.n > 1:
            return await self.drafts(request, slot, req, Shaper(slot.name, chat=True),
                                     jobs.drafts_job(slot, req, messages=messages, client=client), client=client)
        used = jobs.JobUsage()
        return await self.generation(request, slot, req, Shaper(slot.name, chat=True),
                                     jobs.chat_job(slot, messages, req, client, used), used,
                                     client=client, hint=_chat_hint(body, messages))

    async def completions(self, request: Request):
        body = await self.body(request)
        req = parse_common(body, max_tokens_default=16)
        req.logprobs = _logprobs(body, req, chat=False)
        req.prediction = parse_prediction(body, req.n)
        prompt = parse_prompt(body)
        fmt = parse_output_format(body, chat=False)
        slot = self.model_for(req)
        request.state.model = slot.name
        req.grammar = await _compiled(slot, fmt, req)
        suffix = body.get("suffix")
        if isinstance(suffix, str) and suffix:
            if not isinstance(prompt, str):
                raise ApiError(400, "'suffix' needs the prompt as text.", "invalid_value", "suffix")
            ids = await asyncio.to_thread(jobs.infill_prompt, slot, prompt, suffix)
        else:
            ids = await self.prompt_ids(slot, prompt)
        self.check_fits(slot, ids)
        shaper = Shaper(slot.name, chat=False)
        client = _client(request)
        if req.n > 1:
            return await self.drafts(request, slot, req, shaper, jobs.drafts_job(slot, req, ids=ids, client=client),
                                     client=client)
        used = jobs.JobUsage()
        return await self.generation(request, slot, req, shaper, jobs.completion_job(slot, ids, req, client, used),
                                     used, text_start=len(_text(slot, prompt)), client=client)

    async def completion(self, request: Request):
        """llama-server's ``/completion`` (see :mod:`.llama_completion`)."""
        body = await self.body(request)
        req = parse_common(body, max_tokens_key="n_predict")
        req.logprobs = parse_n_probs(body)
        prompt = parse_prompt(body)
        fmt = parse_output_format(body, chat=False)
        slot = self.model_for(req)
        request.state.model = slot.name
        req.grammar = await _compiled(slot, fmt, req)
        return_tokens = flag(body, "return_tokens")
        ids = await self.prompt_ids(slot, prompt)
        self.check_fits(slot, ids)
        client = _client(request)
        used = jobs.JobUsage()
        job, items, first, watcher = await queued.start(request, slot,
                                                      jobs.completion_job(slot, ids, req, client, used), client=client)
        if req.stream:
            watcher.cancel()
            return llama_completion.completion_stream(first, items, job, req=req, model=slot.name,
                                                      config=self.stream_config, streams=self.streams,
                                                      token_bytes=slot.target.token_bytes, used=used,
                                                      return_tokens=return_tokens)
        lps: list | None = [] if req.logprobs is not None else None
        done = await queued.final(first, items, watcher, job, logprobs=lps)
        request.state.stats = done.stats
        probs = None if lps is None else llama_probabilities(lps, slot.target.token_bytes)
        return JSONResponse(llama_completion.done_body(done, req, slot.name, used.cached_tokens, probs,
                                                       done.tokens if return_tokens else None))

    async def infill(self, request: Request):
        """llama-server's /infill (see :mod:`.infill_api`)."""
        req = infill_api.parse_infill(await self.body(request))
        slot = self.model_for(req.gen)
        request.state.model = slot.name
        built = await asyncio.to_thread(infill_api.build_prompt, slot, req)
        ids = built.tokens
        self.check_fits(slot, ids)
        fmt = infill_api.fim_format(slot.target)
        client = _client(request)
        if req.gen.n > 1:
            job, items, first, watcher = await queued.start(request, slot,
                                                          jobs.drafts_job(slot, req.gen, ids=ids, client=client),
                                                          kind=INFILL, client=client)
            watcher.cancel()
            d: jobs.Drafts = queued.drafts_or_cancelled(first)
            return JSONResponse({"content": d.texts[0][0] if d.texts else "", "stop": True, "model": slot.name,
                                 "drafts": [t for t, _ in d.texts], "tokens_evaluated": len(ids),
                                 "tokens_predicted": d.completion_tokens, "fim": fmt is not None})
        job, items, first, watcher = await queued.start(request, slot,
                                                      infill_api.infill_job(slot, ids, req, client, self.cache_reuse),
                                                      kind=INFILL, client=client)

        def final_body(done: InfillDone) -> dict:
            return infill_api.done_body(done, req, slot.name, built, fmt)

        if req.gen.stream:
            watcher.cancel()
            return infill_stream(first, items, job, model=slot.name, final_body=final_body,
                                 config=self.stream_config, streams=self.streams)
        done = await queued.final(first, items, watcher, job, last=InfillDone)
        return JSONResponse(final_body(done))

    async def generation(self, request: Request, slot: ModelSlot, req: GenRequest, shaper: Shaper, fn,
                         used: jobs.JobUsage, text_start: int = 0, tools: ToolRequest | None = None,
                         client: str = "", hint: str = ""):
        """``text_start``: where the reply's text begins for legacy ``text_offset`` (after the
        prompt, as OpenAI and llama-cpp-python count without ``echo``). ``tools``: the
        request offered tools, so the reply's calls become ``tool_calls``. ``client`` and
        ``hint``: which lane it goes to (:mod:`.worker`)."""
        names = frozenset(t.name for t in tools.offered) if tools is not None else frozenset()
        job, items, first, watcher = await queued.start(request, slot, fn, client=client, hint=hint)
        if req.stream:
            watcher.cancel()

            def on_stats(stats) -> None:
                request.state.stats = stats

            return generation_stream(first, items, job, shaper=shaper, token_bytes=slot.target.token_bytes,
                                     include_usage=req.include_usage, used=used, on_stats=on_stats,
                                     config=self.stream_config, streams=self.streams, text_start=text_start,
                                     tool_calls=ToolCallParser(names) if tools is not None else None)
        lps: list | None = [] if req.logprobs is not None else None
        done = await queued.final(first, items, watcher, job, logprobs=lps)
        st = request.state.stats = done.stats
        body = shaper.full([(done.text, finish_reason(st.finish_reason))],
                           usage(st.prompt_tokens, st.generated_tokens, used.cached_tokens, used.prediction),
                           {"tandem": {"stats": st.as_dict()}})
        if tools is not None:
            reply = parse_reply(done.text, names)
            choice = body["choices"][0]
            choice["message"]["content"] = reply.content
            if reply.calls:
                choice["message"]["tool_calls"] = reply.calls
                if st.finish_reason != "length":  # a call cut by max_tokens keeps "length", as OpenAI's
                    choice["finish_reason"] = "tool_calls"
        if lps is not None:
            body["choices"][0]["logprobs"] = shape(lps, slot.target.token_bytes, chat=shaper.chat, offset=text_start)
        return JSONResponse(body)

    async def drafts(self, request: Request, slot: ModelSlot, req: GenRequest, shaper: Shaper, fn,
                     client: str = ""):
        job, items, first, watcher = await queued.start(request, slot, fn, client=client)
        watcher.cancel()
        d = queued.drafts_or_cancelled(first)
        use = usage(d.prompt_tokens, d.completion_tokens)
        extra = {"tandem": {"sampled": True} if d.result is None else {"superposed": {
            "forward_passes": d.result.forward_passes, "steps": d.result.steps, "elapsed_s": d.result.elapsed_s}}}
        if not req.stream:
            return JSONResponse(shaper.full(d.texts, use, extra))
        return drafts_stream(shaper, d.texts, use if req.include_usage else None, config=self.stream_config,
                             streams=self.streams)


def _chat_hint(body: dict, messages: list[dict]) -> str:
    """A chat request as text that the next turn's starts with (:attr:`~.worker.Job.hint`):
    the tools (a chat template shows them first), then the messages, brackets left open."""
    return json.dumps([body.get("tools"), messages], ensure_ascii=False, default=str)[:-2]


async def _compiled(slot: ModelSlot, fmt: OutputFormat | None, req: GenRequest) -> Any:
    """``fmt`` compiled for the slot's model, off the event loop (a big schema takes a
    while); a 400 naming the field when it cannot compile."""
    if fmt is None:
        return None
    if req.n > 1:
        raise ApiError(400, f"'{fmt.field}' is not available with n > 1.", "invalid_value", fmt.field)
    return await asyncio.to_thread(compile_format, slot.target, fmt)


def _text(slot: ModelSlot, prompt: str | list[int]) -> str:
    """The prompt as text (ids as the model writes them), where legacy ``text_offset``s count from."""
    return prompt if isinstance(prompt, str) else tokens_text(slot.target.token_bytes, prompt)


def _client(request: Request) -> str:
    return client_identity(request.client.host if request.client else None, request.headers.get("authorization"))


def _logprobs(body: dict, req: GenRequest, *, chat: bool) -> int | None:
    wanted = parse_logprobs(body, chat=chat)
    if wanted is not None and req.n > 1:
        raise ApiError(400, "'logprobs' is not available with n > 1.", "invalid_value", "logprobs")
    return wanted
