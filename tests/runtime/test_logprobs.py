"""Target log-probabilities on every token whatever drafting did; tokens per call of
plain replies."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_config import LlamaConfig
from tandem.runtime.generate import DoneEvent, TokenEvent, generate
from tandem.runtime.logprobs import log_softmax, token_logprobs
from tandem.runtime.speculative.factory import SpecOptions, build_strategy

ONE_THREAD = LlamaConfig(n_ctx=512, n_threads=1)
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture()
def target(stories260k: Path):
    with LlamaCppBackend(stories260k, ONE_THREAD) as backend:
        yield backend


def _run(target, strategy=None, top: int = 3, n: int = 24):
    prompt = target.tokenize("Once upon a time", add_bos=True)
    kwargs = {"strategy": strategy} if strategy is not None else {}
    events = list(generate(target, prompt, Sampler(GREEDY), max_tokens=n, logprobs=top, **kwargs))
    tokens = [t for e in events if isinstance(e, TokenEvent) for t in e.tokens]
    lps = [lp for e in events if isinstance(e, TokenEvent) for lp in (e.logprobs or [])]
    return prompt, tokens, lps, events[-1]


def test_logprobs_are_the_targets_and_the_same_with_drafting(target, stories260k: Path) -> None:
    prompt, tokens, plain, _ = _run(target)
    assert [lp.token for lp in plain] == tokens and len(tokens) == 24
    # the reference: the target's logits at each position, evaluated on their own
    target.truncate(0)
    rows = target.evaluate(prompt + tokens[:-1], logits_for=range(len(prompt) - 1, len(prompt) + len(tokens) - 1))
    reference = log_softmax(rows)
    for i, lp in enumerate(plain):
        assert lp.logprob == pytest.approx(reference[i, tokens[i]], abs=1e-3)
        assert lp.top[0].token == int(np.argmax(rows[i])) == tokens[i]  # greedy: the best token
        assert [t.logprob for t in lp.top] == sorted((t.logprob for t in lp.top), reverse=True)
        assert len(lp.top) == 3
    with LlamaCppBackend(stories260k, ONE_THREAD) as drafter:
        strategy = build_strategy(target, drafter, SpecOptions(mode="model", draft_length=4, measure_cost=False))
        try:
            _, spec_tokens, spec, done = _run(target, strategy)
        finally:
            strategy.close()
    assert done.stats.drafted_tokens > 0 and done.stats.accepted_tokens > 0  # drafting happened
    assert spec_tokens == tokens
    assert [lp.token for lp in spec] == tokens
    for a, b in zip(plain, spec, strict=True):
        assert b.logprob == pytest.approx(a.logprob, abs=1e-3)
        assert [t.token for t in b.top] == [t.token for t in a.top]


def test_no_logprobs_unless_asked(target) -> None:
    prompt = target.tokenize("Once upon a time", add_bos=True)
    events = list(generate(target, prompt, Sampler(GREEDY), max_tokens=4))
    assert all(e.logprobs is None for e in events if isinstance(e, TokenEvent))


def test_token_logprobs_caps_alternatives() -> None:
    rows = np.log(np.array([[0.5, 0.25, 0.125, 0.125]]))
    (lp,) = token_logprobs(rows, [1], top=50)
    assert lp.logprob == pytest.approx(np.log(0.25)) and len(lp.top) == 4 and lp.top[0].token == 0


def test_alternatives_are_legal_tokens_only_under_a_grammar() -> None:
    """A masked row (illegal tokens at -inf, a forced token alone): the alternatives stop
    at the legal ones; an -inf there made the server's reply JSON fail (a 500)."""
    masked = np.array([[0.0, -np.inf, 1.0, -np.inf], [-np.inf, 0.0, -np.inf, -np.inf]], dtype=np.float32)
    first, forced = token_logprobs(masked, [2, 1], top=3)
    assert [t.token for t in first.top] == [2, 0] and all(np.isfinite(t.logprob) for t in first.top)
    assert forced.logprob == 0.0 and [(t.token, t.logprob) for t in forced.top] == [(1, 0.0)]


def test_plain_reply_ending_at_end_of_turn_is_one_token_per_call(real_models) -> None:
    from tandem.runtime.chat import ChatEngine

    with LlamaCppBackend(real_models.smollm2, ONE_THREAD) as t:
        events = list(ChatEngine(t).stream([{"role": "user", "content": "What is 2+2?"}], GREEDY, 64))
    stats = events[-1].stats
    assert isinstance(events[-1], DoneEvent) and stats.finish_reason == "stop"
    assert stats.target_calls == stats.generated_tokens + 1  # the last call decided end-of-turn
    assert stats.tokens_per_call == 1.0
