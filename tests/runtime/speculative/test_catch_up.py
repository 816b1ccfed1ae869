"""A model drafter that has not seen the text yet must catch up on it (one batched call)
before it drafts: the length policy wakes it only where the rest of the reply can repay
that, and learns what a caught-up token costs. Output is the target's either way."""

from __future__ import annotations

import numpy as np
import pytest
from toy_models import ToyBackend, random_table

from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.generate import DoneEvent, autoregressive, generate
from tandem.runtime.speculative.cost import CostCurve
from tandem.runtime.speculative.drafters.base import LONG_CATCH_UP
from tandem.runtime.speculative.drafters.chain import ChainDrafter
from tandem.runtime.speculative.drafters.model import ModelDrafter
from tandem.runtime.speculative.drafters.suffix import SuffixDrafter
from tandem.runtime.speculative.drafting import EXPECTED_REPLY, Reply
from tandem.runtime.speculative.loop import speculative
from tandem.runtime.speculative.policy.adaptive import AdaptivePolicy
from tandem.runtime.speculative.policy.adaptive_config import AdaptiveConfig

CPU = CostCurve((1.0, 1.7, 1.9, 2.1, 2.4, 2.55, 2.7, 2.85, 3.0), 0.1)


def policy(**kw) -> AdaptivePolicy:
    return AdaptivePolicy(CPU, AdaptiveConfig(), draft_cost=0.1, cheap_sources=frozenset({"suffix"}), **kw)


def test_a_long_backlog_is_caught_up_only_where_the_rest_of_the_reply_repays_it() -> None:
    p = policy(catch_up_cost=0.1)
    assert p.next_length() > 0 and p.model_budget  # the model drafter would draft this round
    saved_per_token = 1 - 1 / p.predicted_speedup(p.best_length())
    # 231 prompt tokens at 0.1 steps each: 23 steps, which 64 tokens cannot save
    assert 64 * saved_per_token < 23.1
    assert not p.catch_up_pays("model:draft", 231, 64)
    assert p.catch_up_pays("model:draft", 231, 4096)
    # Where the rest of the reply repays it exactly: the boundary is the price.
    needed = int(np.ceil(231 * 0.1 / saved_per_token))
    assert not p.catch_up_pays("model:draft", 231, needed - 1)
    assert p.catch_up_pays("model:draft", 231, needed + 1)
    # Nothing to catch up on, or a source that drafts from the text itself: always asked.
    assert p.catch_up_pays("model:draft", 0, 1)
    assert p.catch_up_pays("suffix", 10_000, 1)


def test_a_probe_weighs_the_catch_up_against_a_drafter_that_is_never_wrong() -> None:
    p = policy(catch_up_cost=0.1)
    for _ in range(30):  # every draft rejected: the model drafter is switched off
        p.next_length()
        p.observe(4, 0, draft_s=0.12, verify_s=0.21, round_s=0.33, source="model:draft")
    assert p.best_length() == 0
    while not (p.next_length() and p.model_budget):
        pass  # plain rounds until a probe is due: it wakes the drafter if a perfect one would repay that
    ceiling = p.ceiling()
    assert p.catch_up_pays("model:draft", 10, int(10 * 0.1 / (1 - 1 / ceiling)) + 1)
    assert not p.catch_up_pays("model:draft", 10, int(10 * 0.1 / (1 - 1 / ceiling)) - 1)


def test_the_cost_of_a_caught_up_token_is_priced_from_the_target_then_timed() -> None:
    p = policy()
    # Before any catch-up is timed: the drafted-token cost, scaled as the target's own
    # batched call spreads its cost over its tokens.
    assert p.catch_up_per_token() == pytest.approx(0.1 * CPU(8) / 9)
    p.observe_catch_up("suffix", 200, 100.0)  # model-free sources never catch up
    assert p.catch_up_cost is None
    p.observe_catch_up("model:draft", 200, 200 * 0.05 * CPU.t1_s)
    assert p.catch_up_per_token() == pytest.approx(0.05)
    p.observe_catch_up("model:draft", 100, 100 * 0.15 * CPU.t1_s)
    assert p.catch_up_per_token() == pytest.approx(0.10)  # later catch-ups move it


def test_what_is_left_of_a_reply() -> None:
    budgeted = Reply(prompt_len=100, horizon=100 + 64 - 1, budgeted=True)
    assert budgeted.remaining(100) == 63 and budgeted.remaining(150) == 13
    open_ended = Reply(prompt_len=100, horizon=4096, budgeted=False)
    assert open_ended.remaining(100) == EXPECTED_REPLY
    assert open_ended.remaining(100 + EXPECTED_REPLY) == EXPECTED_REPLY  # as long again
    assert Reply(prompt_len=100, horizon=200, budgeted=False).remaining(150) == 50  # the context ends first


class CountingBackend(ToyBackend):
    """A toy that counts the tokens it evaluates."""

    evaluated = 0

    def evaluate(self, tokens, logits_for=None):
        self.evaluated += len(tokens)
        return super().evaluate(tokens, logits_for)


def decode(target: ToyBackend, prompt: list[int], strategy, max_tokens: int) -> list[int]:
    *_, done = generate(target, prompt, Sampler(SamplingParams.greedy_params()), strategy=strategy,
                        max_tokens=max_tokens, stop_at_eog=False)
    assert isinstance(done, DoneEvent)
    return done.tokens


@pytest.mark.parametrize("catch_up_cost, woken", [(1.0, False), (0.001, True)])
def test_a_drafter_behind_a_long_prompt_sleeps_through_a_short_reply(catch_up_cost: float, woken: bool) -> None:
    rng = np.random.default_rng(3)
    table = random_table(64, rng, concentration=0.3)
    target, draft_model = ToyBackend(table, "target"), CountingBackend(table, "draft")
    prompt = [int(t) for t in rng.integers(1, 64, 300)]
    plain = decode(target, prompt, autoregressive, 24)
    drafter = ModelDrafter(draft_model)
    chain = ChainDrafter([SuffixDrafter(), drafter])
    adaptive = AdaptivePolicy(CPU, AdaptiveConfig(), draft_cost=0.05, catch_up_cost=catch_up_cost,
                              cheap_sources=frozenset({chain.drafters[0].name}))
    assert decode(target, prompt, speculative(chain, adaptive), 24) == plain
    assert (drafter.calls > 0) is woken
    # Asleep, it never evaluated the prompt; woken, it caught up on all of it at once.
    assert (draft_model.evaluated >= len(prompt)) is woken


def test_only_a_long_catch_up_is_reported_apart_from_drafting() -> None:
    """A backlog of a token or a few (what every round leaves) is part of drafting's own
    cost; from :data:`LONG_CATCH_UP` tokens on, the catch-up is reported with its size."""
    rng = np.random.default_rng(5)
    drafter = ModelDrafter(ToyBackend(random_table(32, rng), "draft"))
    greedy = Sampler(SamplingParams.greedy_params())
    context = [int(t) for t in rng.integers(1, 32, 40)]
    assert drafter.backlog(context) == 39  # all but the last token, whose logits draft
    first = drafter.propose(context, 3, greedy)
    assert first.catch_up_tokens == 39 and first.catch_up_s > 0
    drafter.commit([*context, *first.tokens[:2], 7], 2)
    context = [*context, *first.tokens[:2], 7]
    assert drafter.backlog(context) == 0  # its accepted drafts are cached: only the new last token, as every round
    again = drafter.propose(context, 3, greedy)
    assert (again.catch_up_tokens, again.catch_up_s) == (0, 0.0)
    context = context + [int(t) for t in rng.integers(1, 32, LONG_CATCH_UP + 1)]  # text it did not draft
    assert drafter.backlog(context) == LONG_CATCH_UP
    assert drafter.propose(context, 3, greedy).catch_up_tokens == LONG_CATCH_UP
