"""A tool call cut short by ``max_tokens``: told as OpenAI tells it, a partial call in
``tool_calls`` (its arguments as far as they were written), or nothing when not even
its name was whole; never a ``</tool_call>`` the model did not write, never markup as
content, and the same streamed as whole. First with generation scripted (every cut
point of one call), then on the real Qwen2.5-Coder-0.5B."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest

from tandem.app.server import tool_jobs
from tandem.app.server.openai import parse_common
from tandem.app.server.tool_calls import (
    CALL_CLOSE,
    CALL_OPEN,
    CallDelta,
    ToolCallParser,
    collect,
    parse_reply,
)
from tandem.app.server.tools import parse_tools
from tandem.runtime.generate import DoneEvent, GenerationStats, TokenEvent

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["place", "unit"], "properties": {
        "place": {"type": "object", "required": ["city", "country"],
                  "properties": {"city": {"type": "string"}, "country": {"type": "string"}}},
        "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
NAMES = frozenset({"get_weather"})

# -- scripted -------------------------------------------------------------------------

PIECES = ['{"', "name", '": "', "get", "_weather", '", "', "arguments", '": ', '{"', "place", '": {"', "city",
          '": "', "Paris", '"}', "}", "}"]
"""One call's JSON, token by token: ``{"name": "get_weather", "arguments": {"place": {"city": "Paris"}}}``."""
VOCAB = [CALL_OPEN, "\n", CALL_CLOSE, "Sure.", *dict.fromkeys(PIECES)]


class Target:
    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]:
        out, rest = [], text
        while rest:
            i = max((i for i, p in enumerate(VOCAB) if rest.startswith(p)), key=lambda i: len(VOCAB[i]))
            out.append(i)
            rest = rest[len(VOCAB[i]):]
        return out

    def token_bytes(self, t: int) -> bytes:
        return VOCAB[t].encode()


def scripted(monkeypatch, phases: list[tuple[list[str], str]], choice: str = "required") -> list:
    """The events of a tool reply whose phases write ``phases`` (each: its pieces, then how
    it ended), with ``max_tokens`` left high: the scripted finish says where a cut fell."""

    def fake_generate(slot, ids, req, stops, cancel, client, cache):
        pieces, finish = phases.pop(0)
        tokens = [VOCAB.index(p) for p in pieces]
        texts = ["" if p in stops else p for p in pieces]  # a stop string is not in the text
        for text, t in zip(texts, tokens, strict=True):
            yield TokenEvent(text, [t])
        stats = GenerationStats(3, len(tokens), 0.1, 0.2, 5.0, len(tokens), 1.0, 0, 0, None, finish, 0)
        yield DoneEvent("".join(texts), tokens, stats)

    monkeypatch.setattr(tool_jobs, "generate_events", fake_generate)
    tools = parse_tools({"tools": [WEATHER], "tool_choice": choice})
    assert tools is not None
    return list(tool_jobs._phases(SimpleNamespace(target=Target()), [3, 3, 3], parse_common({"max_tokens": 99}),
                                  tools, "GRAMMAR", ["<|im_end|>"], threading.Event(), "", None))


def told(events: list) -> tuple[str | None, list[tuple[str, str]]]:
    """The reply's content and calls, as the server tells it whole; checked to be what a
    streaming client reassembles from the same events."""
    done = events[-1]
    assert isinstance(done, DoneEvent)
    parser = ToolCallParser(NAMES)
    deltas = [d for ev in events[:-1] for d in parser.feed(ev.text)] + parser.finish()
    streamed, whole = collect(deltas), parse_reply(done.text, NAMES)
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in whole.calls]
    assert (streamed.content, [(c["function"]["name"], c["function"]["arguments"]) for c in streamed.calls]) == \
        (whole.content, calls)
    assert "".join(ev.text for ev in events[:-1]) == done.text
    return whole.content, calls


NAMED = [("get_weather", "")]


@pytest.mark.parametrize(("n", "calls"), [
    (1, []), (3, []), (4, []),
    (5, []),  # '{"name": "get_weather': the name's closing quote not yet written
    (6, NAMED), (7, NAMED), (8, NAMED),  # named; the arguments not begun
    (9, [("get_weather", '{"')]),
    (14, [("get_weather", '{"place": {"city": "Paris')]),
    (15, [("get_weather", '{"place": {"city": "Paris"}')]),  # a } of the arguments' own is kept
    (16, [("get_weather", '{"place": {"city": "Paris"}}')]),  # the arguments whole, the call not
])
def test_a_cut_call_is_told_as_far_as_it_was_written(monkeypatch, n: int, calls: list) -> None:
    events = scripted(monkeypatch, [(PIECES[:n], "length")])
    content, got = told(events)
    assert got == calls and content in ("", None)
    assert CALL_CLOSE not in events[-1].text  # no closing tag the model did not write
    if not calls:
        assert events[-1].text == "" and len(events) == 1  # nothing of the call was ever sent


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_a_whole_call_is_closed_even_when_its_last_token_was_the_limit(monkeypatch, finish: str) -> None:
    events = scripted(monkeypatch, [(PIECES, finish)])
    assert told(events) == (None, [("get_weather", '{"place": {"city": "Paris"}}')])
    assert events[-1].text.endswith("\n" + CALL_CLOSE)
    assert events[-1].stats.finish_reason == "stop"  # the limit cut nothing: the reply ends with the call


def test_nothing_of_a_call_is_sent_before_its_header() -> None:
    """The parser gives nothing of a call before ``"arguments": `` either, so holding the
    events back costs a streaming client nothing."""
    parser = ToolCallParser(NAMES)
    assert parser.feed(CALL_OPEN + "\n" + "".join(PIECES[:8])) == []
    first = parser.feed(PIECES[8])[0]
    assert isinstance(first, CallDelta) and first.name == "get_weather"


@pytest.mark.parametrize(("n", "calls"), [(4, []), (14, [("get_weather", '{"place": {"city": "Paris')])])
def test_under_auto_the_text_before_a_cut_call_stays(monkeypatch, n: int, calls: list) -> None:
    events = scripted(monkeypatch, [(["Sure.", CALL_OPEN], "stop"), (PIECES[:n], "length")], choice="auto")
    assert told(events) == ("Sure.", calls)


@pytest.mark.parametrize(("call", "read"), [
    ('{"name": "f', None),
    ('{"name": "f"', '{"name": "f", "arguments": }'),
    ('{"name": "f", "argum', '{"name": "f", "arguments": }'),
    ('{"name": "f", "arguments": {"a": [1', '{"name": "f", "arguments": {"a": [1}'),
    ('{"name": "f", "arguments": {}}', '{"name": "f", "arguments": {}}\n' + CALL_CLOSE),
])
def test_as_read(call: str, read: str | None) -> None:
    assert tool_jobs.as_read(call, cut=True) == read
    assert tool_jobs.as_read(call, cut=False) == call + "\n" + CALL_CLOSE


# -- the real 0.5B -----------------------------------------------------------------------

MODEL = "qwen-0.5b"
ASK = [{"role": "user", "content": "What's the weather in Paris, France, in celsius?"}]


@pytest.fixture(scope="module")
def client(real_models):
    from live_server import serving

    openai = pytest.importorskip("openai")
    with serving(real_models.qwen_05b, MODEL, n_ctx=2048) as (url, _):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300, max_retries=0)


def ask(client, max_tokens: int) -> tuple[str | None, list[tuple[str, str]], str]:
    """A forced call with this limit, whole: content, calls, finish_reason."""
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                       temperature=0, max_tokens=max_tokens).choices[0]
    return r.message.content, [(c.function.name, c.function.arguments) for c in r.message.tool_calls or []], \
        r.finish_reason


def ask_streamed(client, max_tokens: int) -> tuple[str, list[tuple[str, str]], str | None]:
    """The same, streamed and reassembled as a client does."""
    content, calls, finish = "", [], None
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                                temperature=0, max_tokens=max_tokens, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                if d.id is not None:
                    calls.append([d.function.name, ""])
                calls[d.index][1] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [tuple(c) for c in calls], finish


def test_the_reported_reply_is_no_call_and_no_markup(client) -> None:
    """``max_tokens: 5`` under ``required`` was ``<tool_call>\\n{"name": "get\\n</tool_call>``
    as content; the name is not whole, so no call, no content."""
    content, calls, finish = ask(client, 5)
    assert (content or "", calls, finish) == ("", [], "length")
    assert ask_streamed(client, 5) == ("", [], "length")


def test_every_cut_of_a_real_call_is_a_prefix_of_it_streamed_or_not(client) -> None:
    _, [(name, whole)], finish = ask(client, 100)
    assert name == "get_weather" and finish == "tool_calls"
    assert json.loads(whole)["place"]["city"] == "Paris"
    kinds = set()
    for limit in range(1, 15):  # past the name and into the arguments (the whole call is ~30 tokens)
        content, calls, _ = ask(client, limit)
        assert not content, (limit, content)
        assert (content or "", calls) == ask_streamed(client, limit)[:2], limit
        assert len(calls) <= 1 and all(n == name and whole.startswith(a) for n, a in calls), (limit, calls)
        kinds.add("none" if not calls else "named" if not calls[0][1] else "partial")
    assert kinds == {"none", "named", "partial"}


def test_a_partial_call_keeps_finish_reason_length(client) -> None:
    """As OpenAI's: a call cut by max_tokens says "length", not "tool_calls"."""
    _, calls, finish = ask(client, 16)
    assert calls and finish == "length"
    assert ask_streamed(client, 16)[2] == "length"
