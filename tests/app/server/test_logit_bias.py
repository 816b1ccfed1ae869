"""``logit_bias`` through a real server on the real SmolLM2-135M (speculative decoding on, as
`tandem serve` runs): OpenAI's form through the openai SDK, llama-server's list form with
``false`` on ``/completion``, the reply equal to plain greedy decoding under the same bias,
and clear 400s."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from live_server import serving

from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.chat import chat_prompt
from tandem.runtime.generate import DoneEvent, autoregressive, generate

openai = pytest.importorskip("openai")

QUESTION = [{"role": "user", "content": "List three fruits, one per line."}]


@pytest.fixture(scope="module")
def server(real_models):
    with serving(real_models.smollm2, "smol") as (url, slot):
        assert slot.speculative.startswith("on")
        yield url, slot


def _plain(slot, ids: list[int], n: int, bias: tuple = ()) -> list[int]:
    """Plain greedy decoding of the target under ``bias`` (no drafting)."""
    with slot.engine.lock:
        done = list(generate(slot.target, ids, Sampler(SamplingParams(temperature=0.0, logit_bias=bias)),
                             strategy=autoregressive, max_tokens=n))[-1]
    assert isinstance(done, DoneEvent)
    return done.tokens


def _text(slot, tokens: list[int]) -> str:
    return b"".join(slot.target.token_bytes(t) for t in tokens).decode()


def test_a_bias_steers_the_reply_as_plain_decoding_under_it(server) -> None:
    url, slot = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
    ids = chat_prompt(slot.target, QUESTION)[0]
    free = _plain(slot, ids, 40)
    banned = int(np.bincount(free).argmax())  # the token the free reply uses most (a newline, say)

    reply = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=40, temperature=0,
                                           logit_bias={str(banned): -100})
    biased = _plain(slot, ids, 40, ((banned, -100.0),))
    assert banned not in biased and biased != free
    assert reply.choices[0].message.content == _text(slot, biased)
    assert reply.usage.completion_tokens == len(biased)

    forced = slot.target.tokenize(" Kiwi")[0]
    first = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=1, temperature=0,
                                           logit_bias={str(forced): 100})
    assert first.choices[0].message.content == _text(slot, [forced])


def test_llama_servers_list_form_and_false_ban(server) -> None:
    url, slot = server
    prompt = "Apples, pears, apples, pears, apples,"
    ids = slot.target.tokenize(prompt, add_bos=True, special=True)
    free = _plain(slot, ids, 16)
    banned = free[1]
    r = httpx.post(f"{url}/completion", json={"prompt": prompt, "n_predict": 16, "temperature": 0,
                                             "logit_bias": [[banned, False]]}, timeout=60)
    assert r.status_code == 200, r.text
    biased = _plain(slot, ids, 16, ((banned, -np.inf),))
    assert banned not in biased
    assert r.json()["content"] == _text(slot, biased)


@pytest.mark.parametrize(("extra", "param"), [
    ({"logit_bias": {"49152": 5}}, "logit_bias"),  # past SmolLM2's 49152 ids
    ({"logit_bias": {"hello": 5}}, "logit_bias"),
    ({"logit_bias": {"12": "up"}}, "logit_bias"),
    ({"logit_bias": [[12, True]]}, "logit_bias"),
    ({"logit_bias": [12, 5]}, "logit_bias"),
    ({"logit_bias": {"12": 5}, "n": 2}, "logit_bias"),  # n drafts from one superposed decode
    ({"repetition_penalty": 1.2, "n": 2}, "repetition_penalty"),
])
def test_what_cannot_be_honoured_is_a_400(server, extra: dict, param: str) -> None:
    url, _ = server
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 4, "temperature": 0,
                                                        **extra}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
