"""`/infill` as llama.vim and llama.vscode call it: recorded request shapes
(tests/infill_requests/*.json) against a real server holding the real Qwen2.5-Coder-0.5B,
driven by a real HTTP client. Generations are short (a line or so)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from live_server import running

REQUESTS = Path(__file__).parent / "infill_requests"
RIGHT_FILL = 'rectangle_area(shape["width"], shape["height"])'


def _request(name: str, **override) -> dict:
    body = json.loads((REQUESTS / f"{name}.json").read_text())
    body.update(override)
    return body



@pytest.fixture(scope="module")
def qwen_server(real_models):
    """The server as `tandem serve` builds it (speculative decoding on, the default)."""
    from tandem.app.server.asgi import ServerConfig, create_app
    from tandem.app.server.loaded_models import make_slot
    from tandem.runtime.backends.llama import LlamaCppBackend
    from tandem.runtime.backends.llama_config import LlamaConfig

    target = LlamaCppBackend(real_models.qwen_05b, LlamaConfig(n_ctx=2048, n_threads=2))
    slot = make_slot(target, name="qwen")
    app = create_app([slot], ServerConfig())
    with running(app, start_timeout=60) as url:
        yield url, slot
    slot.close()


def _post(url: str, body: dict) -> dict:
    r = httpx.post(f"{url}/infill", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_llama_vim_session(qwen_server) -> None:
    """Warm-up (nothing back, cache filled), then the FIM request: the right fill, with
    the extra files reused from the cache and only llama.vim's response fields."""
    url, slot = qwen_server
    with slot.engine.lock:
        slot.target.truncate(0)
    assert _post(url, _request("llama_vim_warmup")) == {}  # response_fields [""]
    warmed = len(slot.target.tokens)
    assert warmed > 80  # the two extra files (93 tokens with their headers) are in the KV cache now
    body = _post(url, _request("llama_vim_fim_first", n_predict=16))
    assert set(body) == set(_request("llama_vim_fim")["response_fields"])
    assert body["content"].startswith(RIGHT_FILL), body["content"]
    assert body["tokens_cached"] == warmed - 2  # all but the warm-up's empty <|fim_suffix|><|fim_middle|>
    assert body["timings/prompt_n"] < 200 and body["timings/predicted_n"] > 0
    assert body["truncated"] is False


def test_llama_vscode_session(qwen_server) -> None:
    url, _ = qwen_server
    warm = _post(url, _request("llama_vscode_warmup"))
    assert warm["content"] == "" and warm["timings"]["predicted_n"] == 0 and warm["stop_type"] == "limit"
    body = _post(url, _request("llama_vscode_fim", n_predict=16))
    assert body["content"].startswith(RIGHT_FILL), body["content"]
    assert body["tokens_cached"] == body["tokens_evaluated"] - 1  # the warm-up had exactly this prompt
    assert body["timings"]["prompt_n"] == 1
    assert body["stop_type"] in ("eos", "limit") and body["tandem"]["fim_format"] == "qwen"
    for key in ("prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_ms", "predicted_per_token_ms",
                "predicted_per_second"):
        assert body["timings"][key] >= 0
    # every later line of the suggestion is indented at least as much as the cursor line
    assert all(len(line) - len(line.lstrip()) >= 12 for line in body["content"].split("\n")[1:] if line.strip())


def test_n_indent_and_stop_words(qwen_server) -> None:
    url, _ = qwen_server
    body = _post(url, _request("llama_vscode_fim_no_extra", n_predict=8, stop=["shape"]))
    assert body["stop_type"] == "word" and body["stopping_word"] == "shape"
    assert body["content"] == "rectangle_area("
    # n_indent past the cursor's indentation: the first later line ends the suggestion
    body = _post(url, _request("llama_vscode_fim_no_extra", n_predict=12, n_indent=40,
                               prompt="            total += rectangle_area(shape[\"width\"], shape[\"height\"])\n"))
    assert body["stop_type"] in ("limit", "eos")
    assert "\n" not in body["content"].rstrip("\n")


def test_streamed_infill_matches_the_reply(qwen_server) -> None:
    url, _ = qwen_server
    body = _request("llama_vscode_fim_no_extra", n_predict=8)
    full = _post(url, body)
    with httpx.stream("POST", f"{url}/infill", json=body | {"stream": True}, timeout=120) as r:
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    assert "".join(e["content"] for e in events) == full["content"]
    assert events[-1]["stop"] is True and events[-1]["stop_type"] == full["stop_type"]


def test_seeded_sampling_repeats_under_default_drafting(qwen_server) -> None:
    """Three identical seeded requests (speculation on, its suffix tree learning from
    each) give one text; another seed may differ."""
    url, _ = qwen_server
    body = _request("llama_vscode_fim_no_extra", n_predict=8, temperature=0.9, top_p=1.0, seed=1234,
                    cache_prompt=True)
    texts = {_post(url, body)["content"] for _ in range(3)}
    assert len(texts) == 1 and next(iter(texts))


def test_n_choices_honour_temperature_and_seed(qwen_server) -> None:
    """n sampled sequences at a temperature (superposed drafts at temperature 0 are
    tested on stories260K in test_server.py)."""
    url, _ = qwen_server
    base = {"prompt": "def fibonacci(n):\n", "max_tokens": 6, "n": 3}
    hot = base | {"temperature": 1.2, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 99}
    first = httpx.post(f"{url}/v1/completions", json=hot, timeout=120).json()
    again = httpx.post(f"{url}/v1/completions", json=hot, timeout=120).json()
    texts = [c["text"] for c in first["choices"]]
    assert first["tandem"] == {"sampled": True}
    assert texts == [c["text"] for c in again["choices"]]  # seeded: reproducible
    assert len(set(texts)) > 1  # three samples, not one text three times


@pytest.mark.parametrize(("field", "value"), [
    ("input_extra", "not a list"), ("input_extra", [{"text": 3}]), ("n_indent", -1), ("n_indent", "4"),
    ("t_max_predict_ms", "fast"), ("cache_prompt", "yes"), ("response_fields", "content"), ("input_prefix", 7),
])
def test_bad_fields_are_clear_400s(qwen_server, field: str, value) -> None:
    url, _ = qwen_server
    r = httpx.post(f"{url}/infill", json=_request("llama_vscode_fim_no_extra") | {field: value}, timeout=30)
    assert r.status_code == 400 and field in r.json()["error"]["message"]


def _post_from(url: str, body: dict, *, source: str = "127.0.0.1", key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=120) as client:
        r = client.post(f"{url}/infill", json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("other", [{"source": "127.0.0.2"}, {"key": "someone-else"}])
def test_prompt_cache_is_not_shared_between_clients(qwen_server, other) -> None:
    """Another client's identical prompt must not show up as cached: ``tokens_cached`` (and
    the prompt time it saves) would tell it how much of its text matches ours."""
    url, _ = qwen_server
    warm = _request("llama_vscode_warmup")
    _post_from(url, warm)
    assert _post_from(url, warm)["tokens_cached"] > 0  # the same client reuses its own prefix
    stranger = _post_from(url, warm, **other)
    assert stranger["tokens_cached"] == 0 and stranger["timings"]["prompt_n"] == stranger["tokens_evaluated"]
    assert _post_from(url, warm)["tokens_cached"] == 0  # the cache now holds the stranger's prompt


UTILS = {"filename": "utils.py", "text": "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n\n\n"
                                         "def lerp(a, b, t):\n    return a + (b - a) * t\n"}


def test_cache_reuse_keeps_the_extra_chunks_that_moved(real_models) -> None:
    """llama.vim's ring of extra chunks rotates (the oldest file leaves the front): with
    ``tandem serve --cache-reuse N`` the chunks both requests share are shifted into place
    rather than evaluated again, and the fill is still the right one."""
    from tandem.app.server.asgi import ServerConfig, create_app
    from tandem.app.server.loaded_models import make_slot
    from tandem.runtime.backends.llama import LlamaCppBackend
    from tandem.runtime.backends.llama_config import LlamaConfig

    base = _request("llama_vim_fim", n_predict=16, t_max_predict_ms=0)
    first = base | {"input_extra": [UTILS, *base["input_extra"]]}
    for reuse, expect_most in ((0, False), (32, True)):  # a server's shutdown stops its slot: one each
        slot = make_slot(LlamaCppBackend(real_models.qwen_05b, LlamaConfig(n_ctx=2048, n_threads=2)), name="qwen")
        with running(create_app([slot], ServerConfig(cache_reuse=reuse)), start_timeout=60) as url:
            _post(url, first | {"n_predict": 0})
            body = _post(url, base)
        slot.close()
        cached, evaluated = body["tokens_cached"], body["timings/prompt_n"]
        assert body["content"].startswith(RIGHT_FILL), body["content"]
        assert (cached > evaluated) is expect_most, (reuse, cached, evaluated)


def test_asking_again_with_the_accepted_part_drafts_the_rest(real_models) -> None:
    """llama.vim asks again once part of a suggestion is accepted (the prompt grows by it):
    the rest of the previous suggestion, still in that client's cache, is drafted and
    accepted, and the fill is the one a fresh request from another client gets (lossless).
    A fixed draft length, so the test does not depend on this CPU's verify costs."""
    from tandem.app.server.asgi import ServerConfig, create_app
    from tandem.app.server.loaded_models import isolated, slot_for
    from tandem.runtime.backends.llama import LlamaCppBackend
    from tandem.runtime.backends.llama_config import LlamaConfig
    from tandem.runtime.engine.builder import engine_for
    from tandem.runtime.engine.spec import EngineSpec

    target = LlamaCppBackend(real_models.qwen_05b, LlamaConfig(n_ctx=2048, n_threads=2))
    spec = isolated(EngineSpec(real_models.qwen_05b, draft_mode="ngram", draft_len=6))
    slot = slot_for(engine_for(target, spec), name="qwen")
    try:
        with running(create_app([slot], ServerConfig()), start_timeout=60) as url:
            first = _request("llama_vscode_fim_no_extra", n_predict=24, n_indent=0, t_max_predict_ms=0)
            suggestion = _post(url, first)["content"]
            assert suggestion.startswith("rectangle_area("), suggestion
            again = first | {"prompt": first["prompt"] + "rectangle_"}
            primed = _post(url, again)
            other = httpx.post(f"{url}/infill", json=again, headers={"Authorization": "Bearer someone-else"},
                               timeout=120).json()
    finally:
        slot.close()
    assert primed["content"] == other["content"]
    assert suggestion.startswith("rectangle_" + primed["content"][:12])
    assert primed["tandem"]["accepted_drafts"] > other["tandem"]["accepted_drafts"]
    assert primed["tandem"]["target_calls"] < primed["timings"]["predicted_n"]
