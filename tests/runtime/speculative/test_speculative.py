"""Greedy speculative decoding is token-identical to plain decoding on real models, and
both KV caches hold exactly the committed tokens after every round."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.errors import TandemError
from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_config import LlamaConfig
from tandem.runtime.backends.protocol import Backend
from tandem.runtime.generate import DoneEvent, autoregressive, generate
from tandem.runtime.speculative.cost import FIRST_SIZES, CostCurve, OnlineCost
from tandem.runtime.speculative.drafters.base import Drafter
from tandem.runtime.speculative.drafters.chain import ChainDrafter
from tandem.runtime.speculative.drafters.lookup import PromptLookupDrafter
from tandem.runtime.speculative.drafters.model import ModelDrafter
from tandem.runtime.speculative.drafters.suffix import GlobalSuffixCache, SuffixDrafter
from tandem.runtime.speculative.factory import SpecOptions, build_strategy
from tandem.runtime.speculative.loop import speculative
from tandem.runtime.speculative.policy.adaptive import AdaptivePolicy
from tandem.runtime.speculative.policy.adaptive_config import AdaptiveConfig
from tandem.runtime.speculative.policy.base import FixedLength

STORY_PROMPTS = [
    "Once upon a time", "Lily went to the park", "The little dog", "Tom had a big red ball",
    "One day, a cat", "The sun was shining", "Mom said", "There was a tree",
    "Sam and Anna", "The bird flew", "A girl named Sue", "The boy was sad because",
    "In the garden", "The fish swam", "Ben liked to", "It was a rainy day",
    "The old man", "She found a box", "They played with the", "The car went",
]
N_TOKENS = 128


def prompts_for(backend: Backend) -> list[list[int]]:
    """20 story prompts, 2 random-token prompts, 2 repetitive ones (text repeated)."""
    out = [backend.tokenize(p, add_bos=True) for p in STORY_PROMPTS]
    rng = np.random.default_rng(0)
    out += [[int(t) for t in rng.integers(3, backend.n_vocab, 12)] for _ in range(2)]
    story = "Lily saw a big dog. The dog was happy. Lily saw a big dog. The dog"
    out += [backend.tokenize(story, add_bos=True), backend.tokenize(story * 2, add_bos=True)]
    return out


def run(target: Backend, prompt: list[int], strategy, **kw) -> DoneEvent:
    sampler = Sampler(SamplingParams(**kw) if kw else SamplingParams.greedy_params())
    *_, done = generate(target, prompt, sampler, strategy=strategy, max_tokens=N_TOKENS, stop_at_eog=False)
    assert isinstance(done, DoneEvent)
    return done


class CacheChecker:
    """Round hook: target cache == committed minus the last token; drafter cache a prefix."""

    def __init__(self) -> None:
        self.rounds = 0

    def __call__(self, target: Backend, drafter: Drafter, context: list[int]) -> None:
        self.rounds += 1
        assert target.tokens == context[:-1]
        for d in getattr(drafter, "drafters", [drafter]):
            if isinstance(d, ModelDrafter):
                cached = d.backend.tokens
                assert cached == context[: len(cached)]


def assert_identical(target: Backend, drafter: Drafter, policy, prompts, **kw) -> dict:
    checker = CacheChecker()
    strategy = speculative(drafter, policy, hook=checker)
    totals = {"drafted": 0, "accepted": 0, "calls": 0, "tokens": 0}
    for prompt in prompts:
        plain = run(target, prompt, autoregressive, **kw)
        spec = run(target, prompt, strategy, **kw)
        assert spec.tokens == plain.tokens, f"prompt {prompt[:6]}..."
        assert target.tokens == (prompt + spec.tokens)[: len(target.tokens)]
        totals["drafted"] += spec.stats.drafted_tokens
        totals["accepted"] += spec.stats.accepted_tokens
        totals["calls"] += spec.stats.target_calls
        totals["tokens"] += spec.stats.generated_tokens
    assert checker.rounds > 0
    return totals


ONE_THREAD = LlamaConfig(n_ctx=512, n_threads=1)
"""One thread: on a busy 2-core machine, two spinning threads per call are 100x slower."""


@pytest.fixture()
def stories_target(stories260k):
    backend = LlamaCppBackend(stories260k, ONE_THREAD)
    yield backend
    backend.close()


@pytest.fixture()
def stories_draft(stories260k):
    backend = LlamaCppBackend(stories260k, ONE_THREAD)
    yield backend
    backend.close()


def test_greedy_identity_self_drafter(stories_target, stories_draft) -> None:
    totals = assert_identical(stories_target, ModelDrafter(stories_draft, owns_backend=False),
                              FixedLength(4), prompts_for(stories_target))
    assert totals["accepted"] > 0.95 * totals["drafted"]  # same model: near-perfect acceptance
    assert totals["calls"] < totals["tokens"] / 3


@pytest.mark.parametrize("make", [PromptLookupDrafter, lambda: SuffixDrafter(global_cache=GlobalSuffixCache())])
def test_greedy_identity_model_free(stories_target, make) -> None:
    totals = assert_identical(stories_target, make(), FixedLength(5), prompts_for(stories_target))
    assert totals["drafted"] > 0 and totals["calls"] < totals["tokens"]


def test_greedy_identity_chain_adaptive_with_penalty(stories_target, stories_draft) -> None:
    chain = ChainDrafter([SuffixDrafter(), PromptLookupDrafter(), ModelDrafter(stories_draft, owns_backend=False)])
    policy = AdaptivePolicy(CostCurve.linear(0.3), AdaptiveConfig(max_len=6, stop_threshold=0.5))
    prompts = prompts_for(stories_target)[::3]
    assert_identical(stories_target, chain, policy, prompts, temperature=0.0, repetition_penalty=1.3)


def test_greedy_identity_with_presence_and_frequency_penalties(stories_target, stories_draft) -> None:
    """OpenAI's penalties read each position's history, drafted positions included."""
    chain = ChainDrafter([SuffixDrafter(), PromptLookupDrafter(), ModelDrafter(stories_draft, owns_backend=False)])
    prompts = prompts_for(stories_target)[::3]
    totals = assert_identical(stories_target, chain, FixedLength(4), prompts, temperature=0.0,
                              presence_penalty=0.8, frequency_penalty=0.6)
    assert totals["accepted"] > 0


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.8, "seed": 11}])
def test_identity_under_a_logit_bias(stories_target, stories_draft, sampling) -> None:
    """A bias applies to the target's every verified position: speculative output is the
    biased plain output, greedy and seeded, and the bias changes it."""
    chain = ChainDrafter([SuffixDrafter(), PromptLookupDrafter(), ModelDrafter(stories_draft, owns_backend=False)])
    prompts = prompts_for(stories_target)[::3]
    unbiased = [run(stories_target, p, autoregressive, **sampling).tokens for p in prompts]
    common = np.bincount(np.concatenate(unbiased)).argmax()  # the token these replies use most
    bias = ((int(common), -np.inf), (int(common) + 1, 2.0))
    totals = assert_identical(stories_target, chain, FixedLength(4), prompts, logit_bias=bias, **sampling)
    assert totals["accepted"] > 0
    biased = [run(stories_target, p, autoregressive, logit_bias=bias, **sampling).tokens for p in prompts]
    assert all(int(common) not in tokens for tokens in biased) and biased != unbiased


def _decode_untimed(target: Backend, draft: Backend, prompt: list[int], sampling: dict):
    """Decode ``prompt`` with a fresh untimed policy (suffix, lookup, then the model
    drafter), recording each target call's size and the drafter's calls after each round."""
    model = ModelDrafter(draft, owns_backend=False)
    checker = CacheChecker()
    model_calls: list[int] = []
    sizes: list[int] = []

    def hook(target: Backend, drafter: Drafter, context: list[int]) -> None:
        checker(target, drafter, context)
        model_calls.append(model.calls)

    def recording(tokens, logits_for=None, _evaluate=target.evaluate):
        sizes.append(len(tokens))
        return _evaluate(tokens, logits_for=logits_for)

    cost = OnlineCost.untimed(6, chunk=target.exact_batch)
    policy = AdaptivePolicy(cost, AdaptiveConfig(max_len=6), cheap_sources=frozenset({"suffix", "lookup"}))
    strategy = speculative(ChainDrafter([SuffixDrafter(), PromptLookupDrafter(), model]), policy, hook=hook)
    target.evaluate = recording
    try:
        done = run(target, prompt, strategy, **sampling)
    finally:
        del target.evaluate
    return done, cost, sizes, model_calls


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 5}])
def test_timing_rounds_of_a_new_target_change_no_token(stories_target, stories_draft, sampling) -> None:
    """A target never timed on this machine times its verify calls in its first rounds,
    drafts padded to the sizes wanted: greedy and seeded output stays plain decoding's,
    the sizes are timed, and the model drafter is not woken for them."""
    for prompt in prompts_for(stories_target)[::4]:
        plain = run(stories_target, prompt, autoregressive, **sampling)
        stories_target.truncate(0)  # so the prefill is the first call recorded
        spec, cost, sizes, model_calls = _decode_untimed(stories_target, stories_draft, prompt, sampling)
        assert spec.tokens == plain.tokens
        assert cost.timed and cost.wants_size() == 0
        decode = sizes[1:] if len(prompt) > 1 else sizes  # after the prefill of all but the last prompt token
        assert decode[:5] == [1, 1, *(k + 1 for k in FIRST_SIZES)]  # t1 twice, then each size once
        assert model_calls[:5] == [0] * 5


def test_a_reply_with_no_room_for_the_largest_size_pads_nothing(stories_target, monkeypatch) -> None:
    """`tandem run -n 8` of a new target: after the two t1 rounds there is no room for a
    6-draft call, so no round is padded (with the small sizes timed first, every such run
    paid them, stopped short of the largest and saved nothing). With room, all are timed."""
    import tandem.runtime.speculative.loop as loop
    from tandem.runtime.speculative.timing import for_timing

    timed: list[bool] = []

    def recording(policy, draft, k, context):
        out = for_timing(policy, draft, k, context)
        timed.append(out[1])
        return out

    monkeypatch.setattr(loop, "for_timing", recording)
    prompt = prompts_for(stories_target)[0]
    for max_tokens, times in ((8, False), (24, True)):
        timed.clear()
        cost = OnlineCost.untimed(8, chunk=stories_target.exact_batch)
        assert cost.first_sizes[0] == 6
        strategy = speculative(ChainDrafter([SuffixDrafter(), PromptLookupDrafter()]),
                               AdaptivePolicy(cost, AdaptiveConfig(max_len=8), cheap_drafter=True))
        sampler = Sampler(SamplingParams.greedy_params())
        *_, done = generate(stories_target, prompt, sampler, strategy=strategy, max_tokens=max_tokens,
                            stop_at_eog=False)
        *_, plain = generate(stories_target, prompt, sampler, strategy=autoregressive, max_tokens=max_tokens,
                             stop_at_eog=False)
        assert done.tokens == plain.tokens and timed
        assert any(timed) is times and cost.timed is times


@pytest.mark.parametrize("predraft", [False, True])
@pytest.mark.parametrize("max_tokens", [1, 2, 9, 10, 23])
def test_no_draft_reaches_past_the_tokens_the_caller_takes(stories_target, stories_draft, max_tokens: int,
                                                          predraft: bool) -> None:
    """A round commits its drafts and one more token, so with ``max_tokens`` the last rounds
    draft only what can still be used: the target evaluates no position past the reply
    (a same-model drafter at k = 8, every draft accepted, used to verify up to 8 more),
    and no draft, pre-drafted for the next round or not, reaches past it either."""
    prompt = prompts_for(stories_target)[0]
    evaluated: list[int] = []
    evaluate = stories_target.evaluate

    def counting(tokens, logits_for=None):
        evaluated.append(len(tokens))
        return evaluate(tokens, logits_for=logits_for)

    drafter = ModelDrafter(stories_draft, owns_backend=False)
    reached: list[int] = []
    propose = drafter.propose

    def recording(context, n, sampler):
        reached.append(len(context) + n)
        return propose(context, n, sampler)

    stories_target.evaluate = counting
    drafter.propose = recording
    strategy = speculative(drafter, FixedLength(8), predraft=predraft)
    *_, done = generate(stories_target, prompt, Sampler(SamplingParams.greedy_params()), strategy=strategy,
                        max_tokens=max_tokens, stop_at_eog=False)
    stories_target.evaluate = evaluate
    plain = run(stories_target, prompt, autoregressive)
    assert done.tokens == plain.tokens[:max_tokens]
    assert sum(evaluated) == len(prompt) + max_tokens - 1  # the prompt, then one position per reply token but the last
    assert done.stats.accepted_tokens == max_tokens - done.stats.target_calls
    assert max(reached, default=0) <= len(prompt) + max_tokens - 1


def test_sampling_mode_runs_and_keeps_caches(stories_target, stories_draft) -> None:
    checker = CacheChecker()
    strategy = speculative(ModelDrafter(stories_draft, owns_backend=False), FixedLength(3), hook=checker)
    done = run(stories_target, prompts_for(stories_target)[0], strategy, temperature=0.8, seed=1)
    assert done.stats.generated_tokens == N_TOKENS
    assert 0.5 < done.stats.accepted_tokens / done.stats.drafted_tokens <= 1.0


def test_converted_656k_and_twin_oracle(tinystories656k_gguf, small_twin) -> None:
    """The cost twin computes the 656k model's function: the 656k model is its oracle."""
    with LlamaCppBackend(small_twin, ONE_THREAD) as target, \
            LlamaCppBackend(tinystories656k_gguf, ONE_THREAD) as small:
        prompts = prompts_for(target)[:8]
        totals = assert_identical(target, ModelDrafter(small, owns_backend=False), FixedLength(6), prompts)
        assert totals["accepted"] > 0.9 * totals["drafted"]
        assert_identical(small, ChainDrafter([SuffixDrafter(), PromptLookupDrafter()]), FixedLength(4), prompts)


def test_build_strategy_modes(stories_target, stories260k) -> None:
    prompt = prompts_for(stories_target)[0]
    plain = run(stories_target, prompt, autoregressive)
    for opts, draft in [(SpecOptions(mode="off"), None), (SpecOptions(mode="ngram", measure_cost=False), None),
                        (SpecOptions(mode="model", draft_length=3), stories260k),
                        (SpecOptions(mode="auto", measure_cost=False), stories260k)]:
        strategy = build_strategy(stories_target, draft, opts, llama_config=ONE_THREAD)
        try:
            assert run(stories_target, prompt, strategy).tokens == plain.tokens
            assert strategy.describe()["policy"]
        finally:
            strategy.close()
    with pytest.raises(TandemError):
        build_strategy(stories_target, None, SpecOptions(mode="model"))
    with pytest.raises(TandemError):
        build_strategy(stories_target, None, SpecOptions(mode="bogus"))


def test_other_vocab_model_mode_refused_auto_picks_xvocab(tinystories656k_gguf, stories260k) -> None:
    with LlamaCppBackend(tinystories656k_gguf, LlamaConfig(n_ctx=256, n_threads=1)) as target:
        with pytest.raises(TandemError, match="different vocabulary"):
            build_strategy(target, stories260k, SpecOptions(mode="model"))
        strategy = build_strategy(target, stories260k, SpecOptions(mode="auto", draft_length=4),
                                  llama_config=LlamaConfig(n_ctx=256, n_threads=1))
        try:
            assert "xvocab" in strategy.describe()["drafter"]
            prompt = target.tokenize("Once upon a time", add_bos=True)
            assert run(target, prompt, strategy).tokens == run(target, prompt, autoregressive).tokens
        finally:
            strategy.close()
