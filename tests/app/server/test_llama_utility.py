"""llama-server's endpoints that generate nothing (``/tokenize``, ``/detokenize``,
``/apply-template``, ``/props``) and the paths it also answers without ``/v1``, on a real
server holding the real SmolLM2-135M with two slots, driven by httpx and the openai SDK."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from live_server import serving

openai = pytest.importorskip("openai")

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another one?"}]


@pytest.fixture(scope="module")
def server(real_models):
    with serving(real_models.smollm2, "smol", n_seq=2) as (url, slot):
        yield url, slot


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def test_tokenize_and_detokenize_are_the_models_own(server) -> None:
    url, slot = server
    text = "Tokens, counted before a prompt is sent: naïve café 🚀."
    ids = _post(url, "/tokenize", {"content": text}).json()["tokens"]
    assert ids == slot.target.tokenize(text)
    assert _post(url, "/detokenize", {"tokens": ids}).json() == {"content": text}
    with_bos = _post(url, "/tokenize", {"content": text, "add_special": True}).json()["tokens"]
    assert with_bos == slot.target.tokenize(text, add_bos=True)

    # control-token text is that token unless parse_special is false (llama-server's default: true)
    marker = "<|im_start|>user"
    assert _post(url, "/tokenize", {"content": marker}).json()["tokens"] == slot.target.tokenize(marker, special=True)
    as_text = _post(url, "/tokenize", {"content": marker, "parse_special": False}).json()["tokens"]
    assert as_text == slot.target.tokenize(marker) and len(as_text) > 2

    # pieces: text where a token holds whole characters, bytes where it splits one (the emoji)
    pieces = _post(url, "/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids
    assert any(isinstance(p["piece"], list) for p in pieces)
    raw = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert raw.decode() == text


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/tokenize", {}, "content"),
    ("/tokenize", {"content": ["a", 1]}, "content"),
    ("/tokenize", {"content": "a", "with_pieces": "yes"}, "with_pieces"),
    ("/tokenize", {"content": "a", "model": 3}, "model"),
    ("/detokenize", {"tokens": "1 2 3"}, "tokens"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": [1, 2.5]}, "tokens"),
    ("/apply-template", {"messages": []}, "messages"),
    ("/apply-template", {"messages": CHAT, "tools": "none"}, "tools"),
])
def test_bad_requests_are_400s_naming_the_field(server, path: str, body: dict, field: str) -> None:
    url, _ = server
    r = _post(url, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_unknown_model_is_a_404(server) -> None:
    url, _ = server
    assert _post(url, "/tokenize", {"content": "a", "model": "nope"}).status_code == 404
    assert httpx.get(f"{url}/props", params={"model": "nope"}).status_code == 404


def test_apply_template_is_the_prompt_a_chat_request_reads(server) -> None:
    """The rendered prompt, tokenized as llama-server's clients do (control tokens parsed),
    counts exactly the prompt tokens the chat request is billed for."""
    url, _ = server
    prompt = _post(url, "/apply-template", {"messages": CHAT}).json()["prompt"]
    assert prompt.startswith("<|im_start|>system\nYou are terse.<|im_end|>")
    assert prompt.endswith("<|im_start|>assistant\n")
    counted = _post(url, "/tokenize", {"content": prompt}).json()["tokens"]
    reply = _post(url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "temperature": 0}).json()
    assert reply["usage"]["prompt_tokens"] == len(counted)

    # tools are rendered too, as the chat request renders them (SmolLM2's template has no
    # tool support: they are described in the system message)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with_tools = _post(url, "/apply-template", {"messages": CHAT, "tools": tools}).json()["prompt"]
    assert "get_weather" in with_tools and "get_weather" not in prompt


def test_props_says_context_slots_defaults_and_template(server) -> None:
    url, slot = server
    props = httpx.get(f"{url}/props").json()
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == 512
    assert props["total_slots"] == 2
    assert props["model_alias"] == "smol" and props["model_path"].endswith(".gguf")
    assert props["chat_template"] == slot.target.chat_template() and "im_start" in props["chat_template"]
    assert props["modalities"] == {"vision": False, "audio": False}
    # the defaults are what a request that sets nothing gets: greedy here would differ, and
    # no token limit (-1: until the model ends the reply or the context is full)
    assert settings["params"]["temperature"] == 1.0 and settings["params"]["n_predict"] == -1


def test_an_empty_prompt_is_named_as_such(server) -> None:
    """(It was refused as "context_length_exceeded".)"""
    url, _ = server
    r = _post(url, "/v1/completions", {"prompt": ""})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value", r.text
    assert r.json()["error"]["param"] == "prompt" and "empty" in r.json()["error"]["message"]


def test_a_reply_without_a_token_limit_runs_to_the_context_end(server) -> None:
    """Without ``max_tokens`` (or with -1) a reply is not cut at some default (it was at
    256): it ends where the model ends it, or where the context is full."""
    url, slot = server
    done = _post(url, "/completion", {"prompt": "Once", "n_predict": -1, "ignore_eos": True,
                                      "temperature": 0}).json()
    assert done["stop_type"] == "limit" and done["generation_settings"]["n_predict"] == -1
    assert done["tokens_evaluated"] + done["tokens_predicted"] == slot.target.n_ctx
    chat = _post(url, "/v1/chat/completions", {"messages": CHAT, "ignore_eos": True, "temperature": 0}).json()
    assert chat["choices"][0]["finish_reason"] == "length"
    assert chat["usage"]["prompt_tokens"] + chat["usage"]["completion_tokens"] == slot.target.n_ctx


def test_paths_without_v1_and_model_retrieve(server, stories260k) -> None:
    import shutil

    from tandem.models.paths import models_dir

    url, _ = server
    shutil.copy(stories260k, models_dir() / "in-the-store.gguf")  # listed, not served
    body = {"messages": CHAT, "max_tokens": 8, "temperature": 0}
    assert (_post(url, "/chat/completions", body).json()["choices"]
            == _post(url, "/v1/chat/completions", body).json()["choices"])
    text = {"prompt": "The sky is", "max_tokens": 6, "temperature": 0}
    assert _post(url, "/completions", text).json()["choices"] == _post(url, "/v1/completions", text).json()["choices"]
    assert httpx.get(f"{url}/models").json() == httpx.get(f"{url}/v1/models").json()
    assert httpx.get(f"{url}/v1/health").json()["status"] == "ok"

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60, max_retries=0)
    model = client.models.retrieve("smol")
    assert model.id == "smol" and model.object == "model"
    listed = [m.id for m in client.models.list()]
    assert "in-the-store" in listed
    for name in listed:  # each model of the list, served or in the store
        assert client.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_tokenize_answers_while_every_slot_generates(server) -> None:
    """Counting tokens never waits for a reply: both slots stream long replies, and
    /tokenize answers while they are still streaming."""
    url, _ = server
    body = {"messages": CHAT, "max_tokens": 300, "ignore_eos": True, "temperature": 0, "stream": True}

    async def main() -> tuple[list[bool], list[int]]:
        async with httpx.AsyncClient(base_url=url, timeout=300) as c:
            started = [asyncio.Event(), asyncio.Event()]
            finished = [False, False]

            async def stream(i: int) -> None:
                async with c.stream("POST", "/v1/chat/completions", json=body,
                                    headers={"authorization": f"Bearer user-{i}"}) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data:"):
                            started[i].set()
                finished[i] = True

            tasks = [asyncio.create_task(stream(i)) for i in range(2)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
            ids = (await c.post("/tokenize", json={"content": "still answering"})).json()["tokens"]
            still_streaming = [not f for f in finished]
            await asyncio.wait_for(asyncio.gather(*tasks), 300)
        return still_streaming, ids

    still_streaming, ids = asyncio.run(main())
    assert ids and still_streaming == [True, True]


def test_a_prompt_of_token_ids_is_the_same_prompt(server) -> None:
    """Clients count (and trim) a prompt with /tokenize, then send the ids: OpenAI's
    /v1/completions and llama-server's /completion take them as the text's own tokens."""
    url, _ = server
    text = "The sky is blue because"
    ids = _post(url, "/tokenize", {"content": text, "add_special": True}).json()["tokens"]
    llama = {"n_predict": 8, "temperature": 0}
    by_text = _post(url, "/completion", {**llama, "prompt": text}).json()
    by_ids = _post(url, "/completion", {**llama, "prompt": ids}).json()
    assert by_ids["content"] == by_text["content"] and by_ids["tokens_evaluated"] == len(ids)

    openai_body = {"max_tokens": 8, "temperature": 0, "logprobs": 2}
    expected = _post(url, "/v1/completions", {**openai_body, "prompt": text}).json()["choices"]
    for prompt in (ids, [ids]):
        choices = _post(url, "/v1/completions", {**openai_body, "prompt": prompt}).json()["choices"]
        assert choices == expected  # text, and logprobs' text_offset counted from the same prompt text


@pytest.mark.parametrize(("body", "field"), [
    ({"prompt": [[1, 2], [3]]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 10**9]}, "prompt"),
    ({"prompt": [1, True]}, "prompt"),
    ({"prompt": [1, 2], "suffix": "end"}, "suffix"),
])
def test_bad_token_prompts_are_400s(server, body: dict, field: str) -> None:
    url, _ = server
    for path in ("/v1/completions", "/completion"):
        if path == "/completion" and "suffix" in body:
            continue
        r = _post(url, path, {**body, "max_tokens": 2})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field


def test_completion_says_why_it_stopped_and_what_it_read(server) -> None:
    """/completion's reply as llama-server's: ``stop_type`` "word" with the stop string
    that ended it, "limit" or "eos"; ``timings`` split into prompt and prediction;
    ``tokens_cached`` the prompt tokens found in the cache."""
    url, _ = server
    base = {"prompt": "Count: one, two, three, four, five, six,", "temperature": 0, "n_predict": 12}
    free = _post(url, "/completion", base).json()
    assert free["stop_type"] == "limit" and free["stopping_word"] == ""
    word = free["content"].split()[1]  # a word the model writes, after the first
    stopped = _post(url, "/completion", {**base, "stop": [word, "no such text"]}).json()
    assert stopped["stop_type"] == "word" and stopped["stopping_word"] == word
    assert stopped["content"] == free["content"][: free["content"].index(word)]
    for event in (free, stopped):
        t = event["timings"]
        assert t["prompt_n"] + event["tokens_cached"] == event["tokens_evaluated"]
        assert t["predicted_n"] == event["tokens_predicted"] and t["prompt_ms"] > 0 and t["predicted_ms"] > 0
    assert stopped["tokens_cached"] > 0  # the same client's prompt, read by the request before
    ended = _post(url, "/completion", {"prompt": "<|im_start|>user\nSay yes.<|im_end|>\n<|im_start|>assistant\n",
                                       "temperature": 0, "n_predict": 64}).json()
    assert ended["stop_type"] == "eos"

    with httpx.stream("POST", f"{url}/completion", json={**base, "stop": [word], "stream": True}, timeout=60) as r:
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    assert events[-1]["stop"] is True and events[-1]["stop_type"] == "word" and events[-1]["stopping_word"] == word
    assert "".join(e["content"] for e in events) == stopped["content"]


def test_completion_returns_its_tokens_when_asked(server) -> None:
    url, _ = server
    body = {"prompt": "Emoji: 🚀🎉 and more:", "n_predict": 12, "temperature": 0, "return_tokens": True}
    whole = _post(url, "/completion", body).json()
    assert len(whole["tokens"]) == whole["tokens_predicted"] == 12
    assert _post(url, "/detokenize", {"tokens": whole["tokens"]}).json()["content"] == whole["content"]
    assert "tokens" not in _post(url, "/completion", {**body, "return_tokens": False}).json()
    with httpx.stream("POST", f"{url}/completion", json={**body, "stream": True}, timeout=60) as r:
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    assert [t for e in events for t in e["tokens"]] == whole["tokens"]
    assert "".join(e["content"] for e in events) == whole["content"]


def test_chat_template_kwargs_reach_the_template(server) -> None:
    """llama-server's and vLLM's ``chat_template_kwargs`` (Qwen3's ``enable_thinking``):
    the template reads them in a chat request and in /apply-template alike."""
    url, slot = server
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
                "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
    slot.target.chat_template = lambda: template
    try:
        quiet = {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}
        prompt = _post(url, "/apply-template", quiet).json()["prompt"]
        assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert "<think>" not in _post(url, "/apply-template", {"messages": CHAT}).json()["prompt"]
        counted = len(_post(url, "/tokenize", {"content": prompt}).json()["tokens"])
        reply = _post(url, "/v1/chat/completions", {**quiet, "max_tokens": 1, "temperature": 0}).json()
        assert reply["usage"]["prompt_tokens"] == counted
        for bad in ({"chat_template_kwargs": "enable_thinking=false"}, {"chat_template_kwargs": {"messages": []}}):
            r = _post(url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, **bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
    finally:
        del slot.target.chat_template
