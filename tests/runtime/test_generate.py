"""The generation driver: the documented example, limits, stops, cancel, cache state."""

from __future__ import annotations

import threading

import pytest

from tandem.errors import PromptError
from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.generate import DoneEvent, TokenEvent, generate

GREEDY = SamplingParams.greedy_params()


def run(backend, prompt: str, **kw) -> DoneEvent:
    ids = backend.tokenize(prompt, add_bos=True)
    events = list(generate(backend, ids, Sampler(kw.pop("params", GREEDY)), **kw))
    done = events[-1]
    assert isinstance(done, DoneEvent)
    assert all(isinstance(e, TokenEvent) for e in events[:-1])
    assert "".join(e.text for e in events[:-1]) == done.text
    assert sum((e.tokens for e in events[:-1]), []) == done.tokens
    return done


def test_documented_greedy_example(stories_backend: LlamaCppBackend) -> None:
    done = run(stories_backend, "Once upon a time", max_tokens=12)
    assert done.text.startswith(", there was a little girl named Lily")
    s = done.stats
    assert s.generated_tokens == 12 and s.target_calls == 12 and s.tokens_per_call == 1.0
    assert s.finish_reason == "length" and s.prompt_tokens == 5


def test_cache_holds_prompt_and_output_afterwards(stories_backend: LlamaCppBackend) -> None:
    ids = stories_backend.tokenize("Once upon a time", add_bos=True)
    done = list(generate(stories_backend, ids, Sampler(GREEDY), max_tokens=10))[-1]
    cached = stories_backend.tokens
    assert cached == (ids + done.tokens)[: len(cached)]
    assert len(cached) >= len(ids) + len(done.tokens) - 1


def test_stop_string_cuts_text_and_reports_stop(stories_backend: LlamaCppBackend) -> None:
    done = run(stories_backend, "Once upon a time", max_tokens=40, stop=["Lily"])
    assert done.text == ", there was a little girl named "
    assert done.stats.finish_reason == "stop"


def test_eos_ends_generation(stories_backend: LlamaCppBackend) -> None:
    done = run(stories_backend, "Once upon a time", max_tokens=400)
    assert done.stats.finish_reason in ("stop", "length")
    assert stories_backend.special.eos not in done.tokens


def test_cancel_stops_early_and_keeps_partial(stories_backend: LlamaCppBackend) -> None:
    cancel = threading.Event()
    ids = stories_backend.tokenize("Once upon a time", add_bos=True)
    seen = []
    for ev in generate(stories_backend, ids, Sampler(GREEDY), max_tokens=100, cancel=cancel):
        seen.append(ev)
        if len(seen) == 3:
            cancel.set()
    done = seen[-1]
    assert isinstance(done, DoneEvent) and done.stats.finish_reason == "cancelled"
    assert 3 <= len(done.tokens) < 10


def test_seeded_sampling_is_reproducible(stories_backend: LlamaCppBackend) -> None:
    params = SamplingParams(temperature=1.0, seed=42)
    a = run(stories_backend, "Once upon a time", max_tokens=30, params=params)
    b = run(stories_backend, "Once upon a time", max_tokens=30, params=SamplingParams(temperature=1.0, seed=42))
    assert a.tokens == b.tokens


def test_bad_prompts(stories_backend: LlamaCppBackend) -> None:
    with pytest.raises(PromptError, match="empty"):
        list(generate(stories_backend, [], Sampler(GREEDY)))
    with pytest.raises(PromptError, match="context"):
        list(generate(stories_backend, [1] + [300] * stories_backend.n_ctx, Sampler(GREEDY)))
