"""Constrained decoding on toy models with exact probabilities: every strategy commits
legal tokens only, sampling follows the masked and renormalised distribution exactly,
seeded sampling repeats, forced runs are counted."""

from __future__ import annotations

import numpy as np
import pytest
from toy_grammar import EOS, LANGUAGE, PIECES, REGEX, GrammarToy, exact_replies, spelled
from toy_models import PURE, check_matches, model_distribution, random_table

from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.constrained import GrammarSpec, GrammarState, compile_grammar
from tandem.runtime.constrained.strategy import constrained
from tandem.runtime.generate import DoneEvent, autoregressive, generate
from tandem.runtime.speculative.drafters.model import ModelDrafter
from tandem.runtime.speculative.factory import SpeculativeStrategy
from tandem.runtime.speculative.policy.base import FixedLength

PROMPT = [PIECES.index(b"d")]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def toys() -> tuple[GrammarToy, GrammarToy]:
    rng = np.random.default_rng(7)
    return GrammarToy(random_table(len(PIECES), rng), "target"), GrammarToy(random_table(len(PIECES), rng), "draft")


def strategies(toys):
    target, draft = toys
    return {
        "plain": constrained(autoregressive, compile_grammar(GrammarSpec("regex", REGEX), target), forced_rounds=False),
        "plain+forced": constrained(autoregressive, compile_grammar(GrammarSpec("regex", REGEX), target)),
        "model k=3": constrained(SpeculativeStrategy(ModelDrafter(draft, owns_backend=False), FixedLength(3)),
                                 compile_grammar(GrammarSpec("regex", REGEX), target)),
    }


def reply(target, strategy, params: SamplingParams):
    done = [e for e in generate(target, PROMPT, Sampler(params), strategy=strategy, max_tokens=MAX_TOKENS)][-1]
    assert isinstance(done, DoneEvent)
    return done


def is_legal(tokens: list[int]) -> bool:
    return any(s.startswith(spelled(tokens)) for s in LANGUAGE)


@pytest.mark.parametrize("name", ["plain", "plain+forced", "model k=3"])
def test_sampled_replies_follow_the_masked_distribution_exactly(toys, name) -> None:
    target, _ = toys
    strategy = strategies(toys)[name]
    state = GrammarState(compile_grammar(GrammarSpec("regex", REGEX), target))
    exact = exact_replies(model_distribution(target), PROMPT[-1], MAX_TOKENS, state)
    assert all(is_legal(list(k)) for k in exact)
    keys = sorted(exact)
    counts = np.zeros(len(keys) + 1)
    sampler_params = SamplingParams(**{**PURE.__dict__, "seed": None})
    for _ in range(3000):
        out = tuple(reply(target, strategy, sampler_params).tokens)
        counts[keys.index(out) if out in exact else -1] += 1
    assert counts[-1] == 0, "a reply the grammar does not allow"
    check_matches(counts[:-1], np.array([exact[k] for k in keys]), tv_bound=0.05)


@pytest.mark.parametrize("name", ["plain+forced", "model k=3"])
def test_greedy_and_seeded_replies_are_plain_constrained_decodings(toys, name) -> None:
    target, _ = toys
    plain, other = strategies(toys)["plain"], strategies(toys)[name]
    greedy = SamplingParams.greedy_params()
    assert reply(target, other, greedy).tokens == reply(target, plain, greedy).tokens
    for seed in range(20):
        seeded = SamplingParams(**{**PURE.__dict__, "seed": seed})
        first = reply(target, other, seeded).tokens
        assert first == reply(target, other, seeded).tokens == reply(target, plain, seeded).tokens
        assert is_legal(first)


def test_forced_rounds_are_counted_and_the_end_costs_no_call(toys) -> None:
    target, _ = toys
    strategies_ = strategies(toys)
    greedy = SamplingParams.greedy_params()
    plain = reply(target, strategies_["plain"], greedy)
    forced = reply(target, strategies_["plain+forced"], greedy)
    assert forced.tokens == plain.tokens
    assert forced.stats.forced_tokens > 0 and plain.stats.forced_tokens == 0
    assert forced.stats.target_calls < plain.stats.target_calls
    assert forced.stats.finish_reason == plain.stats.finish_reason == "stop"
    # the end-of-generation after the complete reply was never asked of the target
    assert plain.stats.target_calls == len(plain.tokens)
    assert EOS not in plain.tokens
