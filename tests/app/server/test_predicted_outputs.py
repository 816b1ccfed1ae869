"""OpenAI's Predicted Outputs (``prediction``) through a real server on the real
SmolLM2-135M, driven by the openai SDK: the reply is the one plain decoding gives, whatever
the prediction says; ``usage.completion_tokens_details`` counts the prediction's tokens the
reply used and the rest, whole and streamed; malformed predictions are 400s.

That a right prediction is drafted from and accepted is shown without timing in
``tests/runtime/speculative/test_prediction.py`` (a server's policy prices drafts by the
verify costs it measures, which a loaded test box changes)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from live_server import serving

from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.chat import chat_prompt
from tandem.runtime.generate import DoneEvent, autoregressive, generate
from tandem.runtime.speculative.drafters.prediction import Prediction

openai = pytest.importorskip("openai")

CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
EDIT = [{"role": "user", "content": f"Rename add to plus in this code, and reply with the code only:\n{CODE}"}]
N = 48


@pytest.fixture(scope="module")
def server(real_models):
    with serving(real_models.smollm2, "smol", n_ctx=1024) as (url, slot):
        assert slot.speculative.startswith("on")
        yield url, slot


@pytest.fixture(scope="module")
def client(server):
    url, _ = server
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)


def _plain(slot, ids: list[int]) -> list[int]:
    with slot.engine.lock:
        done = list(generate(slot.target, ids, Sampler(SamplingParams(temperature=0.0)),
                             strategy=autoregressive, max_tokens=N))[-1]
    assert isinstance(done, DoneEvent)
    return done.tokens


def _text(slot, tokens: list[int]) -> str:
    return b"".join(slot.target.token_bytes(t) for t in tokens).decode()


def test_the_reply_is_plain_decoding_whatever_is_predicted(server, client) -> None:
    url, slot = server
    plain = _plain(slot, chat_prompt(slot.target, EDIT)[0])
    text = _text(slot, plain)
    third = len(text) // 3
    predictions = {"the reply": text, "an edited reply": text[:third] + " lorem ipsum dolor " + text[third + 12:],
                   "the code asked about": CODE, "nothing like it": "Zebras graze at dawn. " * 4}
    for kind, predicted in predictions.items():
        r = client.chat.completions.create(model="smol", messages=EDIT, max_tokens=N, temperature=0,
                                           prediction={"type": "content", "content": predicted})
        assert r.choices[0].message.content == text, kind
        size = len(slot.target.tokenize(predicted))
        details = r.usage.completion_tokens_details
        assert details.accepted_prediction_tokens == Prediction(slot.target.tokenize(predicted)).appeared(plain)
        assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == size, kind
        if kind == "the reply":
            assert details.accepted_prediction_tokens >= size - 1
        if kind == "nothing like it":
            assert details.accepted_prediction_tokens <= 2


def test_streamed_usage_and_text_parts_and_completions(server, client) -> None:
    url, slot = server
    plain = _plain(slot, chat_prompt(slot.target, EDIT)[0])
    text = _text(slot, plain)
    parts = [{"type": "text", "text": text[:10]}, {"type": "text", "text": text[10:]}]
    stream = client.chat.completions.create(model="smol", messages=EDIT, max_tokens=N, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            prediction={"type": "content", "content": parts})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    details = chunks[-1].usage.completion_tokens_details
    assert details.accepted_prediction_tokens >= len(slot.target.tokenize(text)) - 1

    prompt = "def fib(n):\n"
    ids = slot.target.tokenize(prompt, add_bos=True, special=True)
    completion = _text(slot, _plain(slot, ids))
    r = client.completions.create(model="smol", prompt=prompt, max_tokens=N, temperature=0,
                                  extra_body={"prediction": {"type": "content", "content": completion}})
    assert r.choices[0].text == completion
    assert r.usage.completion_tokens_details.accepted_prediction_tokens >= len(slot.target.tokenize(completion)) - 1
    without = client.chat.completions.create(model="smol", messages=EDIT, max_tokens=4, temperature=0)
    assert without.usage.completion_tokens_details is None  # nothing predicted, nothing to count


@pytest.mark.parametrize("extra", [
    {"prediction": {"type": "text", "content": "x"}},
    {"prediction": {"type": "content", "content": 12}},
    {"prediction": {"type": "content", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}},
    {"prediction": "def add"},
    {"prediction": {"type": "content", "content": "x"}, "n": 2},
])
def test_a_prediction_that_is_not_text_is_a_400(server, extra: dict) -> None:
    url, _ = server
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": EDIT, "max_tokens": 4, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prediction"


def test_a_prediction_longer_than_the_context_is_counted_not_indexed(server, client) -> None:
    """Only what the reply can reach is drafted from; the rest is rejected, and answering
    does not wait on indexing it."""
    url, slot = server
    rng = np.random.default_rng(0)
    words = " ".join(f"w{int(i)}" for i in rng.integers(0, 10_000, 3000))  # about 3 tokens a word
    r = client.chat.completions.create(model="smol", messages=EDIT, max_tokens=4, temperature=0,
                                       prediction={"type": "content", "content": words})
    details = r.usage.completion_tokens_details
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == len(slot.target.tokenize(words))
    assert len(slot.target.tokenize(words)) > slot.target.n_ctx
