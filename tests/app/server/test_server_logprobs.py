"""Server: logprobs on chat and completions (the target's, with drafting on), the JSON-lines
request log, and /v1/models listing the store. A real uvicorn server, the `openai` client."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from live_server import running, sse_events

from tandem.runtime.logprobs import log_softmax

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def served(stories260k: Path, tmp_path_factory: pytest.TempPathFactory):
    from tandem.app.server.asgi import ServerConfig, create_app
    from tandem.app.server.loaded_models import make_slot
    from tandem.runtime.backends.llama import LlamaCppBackend
    from tandem.runtime.backends.llama_config import LlamaConfig

    log = tmp_path_factory.mktemp("server") / "logs" / "requests.jsonl"
    target = LlamaCppBackend(stories260k, LlamaConfig(n_ctx=256, n_threads=1))
    slot = make_slot(target, name="stories")  # speculative decoding on (model-free drafting)
    app = create_app([slot], ServerConfig(request_log=log))
    with running(app, start_timeout=20) as url:
        yield url, slot, log
    target.close()


def _reference(slot, text: str, n: int) -> tuple[list[int], np.ndarray]:
    """Plain evaluation: the target's log-softmax at each generated position."""
    with slot.engine.lock:
        prompt = slot.target.tokenize(PROMPT, add_bos=True)
        ids = slot.target.tokenize(PROMPT + text, add_bos=True)[len(prompt):]
        slot.target.truncate(0)
        rows = slot.target.evaluate(prompt + ids[:-1], logits_for=range(len(prompt) - 1, len(prompt) + len(ids) - 1))
        slot.target.truncate(0)
    return ids, log_softmax(rows)


def test_completion_logprobs_with_the_openai_client(served) -> None:
    from openai import OpenAI

    url, slot, _ = served
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    r = client.completions.create(model="stories", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs) == 12
    # offsets into prompt + reply, as OpenAI's legacy API and llama-cpp-python count without echo
    assert lp.text_offset[0] == len(PROMPT) and lp.text_offset[1] == len(PROMPT) + len(lp.tokens[0])
    streamed = [o for chunk in client.completions.create(model="stories", prompt=PROMPT, max_tokens=12, temperature=0,
                                                         logprobs=3, stream=True)
                if chunk.choices[0].logprobs for o in chunk.choices[0].logprobs.text_offset]
    assert streamed == lp.text_offset
    ids, ref = _reference(slot, r.choices[0].text, 12)
    for i, value in enumerate(lp.token_logprobs):
        assert value == pytest.approx(ref[i, ids[i]], abs=1e-3)
        assert len(lp.top_logprobs[i]) == 3 and max(lp.top_logprobs[i].values()) == pytest.approx(value, abs=1e-6)


def test_chat_logprobs_streamed_and_whole_agree(served) -> None:
    from openai import OpenAI

    url, _, _ = served
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": PROMPT}]
    whole = client.chat.completions.create(model="stories", messages=messages, max_tokens=10, temperature=0,
                                           logprobs=True, top_logprobs=2)
    content = whole.choices[0].logprobs.content
    assert len(content) == 10 and "".join(c.token for c in content) == whole.choices[0].message.content
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    assert all(c.logprob <= 0 and bytes(c.bytes).decode() == c.token for c in content)
    streamed = []
    for chunk in client.chat.completions.create(model="stories", messages=messages, max_tokens=10, temperature=0,
                                                logprobs=True, top_logprobs=2, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-4)


def test_no_logprobs_unless_asked_and_bad_values_rejected(served) -> None:
    url, _, _ = served
    body = {"model": "stories", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0].get("logprobs") is None
    for bad in ({"logprobs": "yes"}, {"top_logprobs": 3}, {"logprobs": True, "top_logprobs": 21},
                {"logprobs": True, "n": 2}):
        r = httpx.post(f"{url}/v1/chat/completions", json={**body, **bad}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] in ("logprobs", "top_logprobs"), (bad, r.text)
    r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "logprobs": 6}, timeout=60)
    assert r.status_code == 400


def test_every_request_is_one_log_line(served) -> None:
    url, _, log = served
    before = log.read_text().splitlines() if log.exists() else []
    httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0}, timeout=60)
    with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                      json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}) as r:
        assert sse_events(r.iter_lines())[-1] == "[DONE]"
    httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": "x"}, timeout=60)
    httpx.post(f"{url}/infill", json={"input_prefix": "Once upon", "input_suffix": "", "n_predict": 3}, timeout=60)
    deadline = time.monotonic() + 10
    while len(log.read_text().splitlines()) < len(before) + 4:  # the stream's line lands as it closes
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    whole, stream, bad, infill = [json.loads(line) for line in log.read_text().splitlines()[len(before):]]
    assert infill["route"] == "/infill" and infill["model"] == "stories" and infill["status"] == 200
    assert whole["route"] == "/v1/completions" and whole["status"] == 200 and whole["model"] == "stories"
    assert whole["completion_tokens"] == 5 and whole["prompt_tokens"] > 0 and whole["ttft_ms"] >= 0
    assert "tokens_per_call" in whole and "acceptance_rate" in whole and not whole["stream"]
    assert stream["stream"] and stream["completion_tokens"] == 4 and stream["status"] == 200
    assert bad["status"] == 400 and "completion_tokens" not in bad
    assert PROMPT not in log.read_text()  # counts and timings, never the text


def test_models_lists_the_store_with_context_and_memory(served, stories260k: Path) -> None:
    from tandem.models.paths import models_dir

    url, _, _ = served
    shutil.copy(stories260k, models_dir() / "spare.gguf")
    data = httpx.get(f"{url}/v1/models", timeout=60).json()["data"]
    assert [m["id"] for m in data] == ["stories", "spare"]
    served_meta, spare = data[0]["meta"], data[1]["meta"]
    assert served_meta["served"] and served_meta["n_ctx"] == 256
    assert not spare["served"] and spare["context_length"] == 2048 and spare["architecture"] == "llama"
    plan = spare["memory_plan"]
    assert plan["n_ctx"] == 2048 and plan["kv_cache_bytes"] > 0
    assert plan["total_bytes"] == plan["weights_bytes"] + plan["kv_cache_bytes"]
    assert spare["planner"]["status"] in ("pending", "ready")  # the planner runs in the background
    deadline = time.monotonic() + 120
    while spare["planner"]["status"] == "pending":
        assert time.monotonic() < deadline, "the planner's plan never arrived"
        time.sleep(0.1)
        spare = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][1]["meta"]
    planner = spare["planner"]
    assert planner["status"] == "ready" and planner["fits"] is True and planner["n_ctx"] > 0
    assert planner["host_bytes"] > plan["weights_bytes"]


def test_plan_cache_makes_each_file_version_once(tmp_path: Path) -> None:
    from tandem.app.server.catalog import PENDING, PlanCache

    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    calls: list[Path] = []
    cache = PlanCache(make=lambda p: calls.append(p) or {"status": "ready"}, folder=tmp_path / "plans")
    try:
        first = cache.get(model)
        deadline = time.monotonic() + 10
        while cache.get(model) == PENDING:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert first in (PENDING, {"status": "ready"}) and cache.get(model) == {"status": "ready"}
        assert calls == [model]
        model.write_bytes(b"xy")  # a new version of the file: planned again
        while cache.get(model) == PENDING or len(calls) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert len(calls) == 2
    finally:
        cache.close()
    restarted = PlanCache(make=lambda p: calls.append(p) or {"status": "ready"}, folder=tmp_path / "plans")
    try:  # a restarted server lists the plan made before, at once, without planning again
        assert restarted.get(model) == {"status": "ready"} and len(calls) == 2
        model.write_bytes(b"xyz")
        while restarted.get(model) == PENDING or len(calls) < 3:  # a new version: planned again
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert len(list((tmp_path / "plans").glob("*.json"))) == 3  # one per file version
    finally:
        restarted.close()
    failing = PlanCache(make=lambda p: {"status": "error", "error": "no"}, folder=tmp_path / "other")
    try:  # a failed plan is shown but not kept: the next start tries again
        while failing.get(model) == PENDING:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert failing.get(model)["status"] == "error" and not (tmp_path / "other").exists()
    finally:
        failing.close()


@pytest.mark.parametrize("flag,expected", [([], "default"), (["--request-log", "off"], None),
                                           (["--request-log", "REQ"], "given")])
def test_serve_request_log_flag(stories260k: Path, tmp_path: Path, flag: list[str], expected: str | None) -> None:
    from tandem.app.cli import build_parser
    from tandem.app.commands.serve import open_server
    from tandem.models.paths import data_dir

    flag = [str(tmp_path / "r.jsonl") if f == "REQ" else f for f in flag]
    args = build_parser().parse_args(["serve", "-m", str(stories260k), "--no-spec", "--ctx", "128",
                                      "--threads", "1", *flag])
    slot, app = open_server(args)
    try:
        path = app.state.server.config.request_log
        want = {"default": data_dir() / "logs" / "requests.jsonl", None: None, "given": tmp_path / "r.jsonl"}
        assert path == want[expected]
    finally:
        slot.close()


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_under_a_json_schema_are_the_legal_tokens(served, stream: bool) -> None:
    """A reply under a schema (its keys forced): every logprob a JSON number, and the
    alternatives legal tokens only. The -inf of an illegal alternative made this a 500."""
    url, _, _ = served
    schema = {"type": "object", "properties": {"hero": {"type": "string", "maxLength": 12}}, "required": ["hero"]}
    body = {"model": "stories", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 24,
            "temperature": 0, "logprobs": True, "top_logprobs": 5, "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {"name": "h", "schema": schema}}}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    if stream:
        content = [c for e in sse_events(r.text.splitlines())[:-1] if e["choices"] and e["choices"][0].get("logprobs")
                   for c in e["choices"][0]["logprobs"]["content"]]
    else:
        content = r.json()["choices"][0]["logprobs"]["content"]
    assert content and content[0]["token"] == "{" and content[0]["logprob"] == 0.0  # forced: certain
    assert all(len(c["top_logprobs"]) <= 5 and all(t["logprob"] <= 0.0 for t in c["top_logprobs"]) for c in content)
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["{"]


def test_llama_server_n_probs_on_completion(served) -> None:
    """llama-server's ``n_probs`` on ``/completion`` (it was accepted and ignored): the
    target's log-probabilities per token in ``completion_probabilities``, whole and
    streamed alike, and the same as the OpenAI route's ``logprobs``."""
    url, slot, _ = served
    body = {"prompt": PROMPT, "n_predict": 8, "temperature": 0, "n_probs": 3}
    whole = httpx.post(f"{url}/completion", json=body, timeout=60).json()
    probs = whole["completion_probabilities"]
    assert "".join(p["token"] for p in probs) == whole["content"] and len(probs) == 8
    assert all(len(p["top_logprobs"]) == 3 and p["top_logprobs"][0]["id"] == p["id"] for p in probs)
    ids, ref = _reference(slot, whole["content"], 8)
    assert [p["id"] for p in probs] == ids
    assert [p["logprob"] for p in probs] == pytest.approx([ref[i, t] for i, t in enumerate(ids)], abs=1e-3)
    r = httpx.post(f"{url}/completion", json={**body, "stream": True}, timeout=60)
    streamed = [p for e in sse_events(r.text.splitlines()) if isinstance(e, dict)
                for p in e.get("completion_probabilities", [])]
    assert [(p["id"], p["top_logprobs"][0]["id"]) for p in streamed] == [(p["id"], p["top_logprobs"][0]["id"])
                                                                          for p in probs]
    assert "completion_probabilities" not in httpx.post(f"{url}/completion", json={**body, "n_probs": 0},
                                                        timeout=60).json()
    bad = httpx.post(f"{url}/completion", json={**body, "n_probs": 99}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n_probs"
