"""A drafter whose costs here are known opens its model when first asked for a draft:
never when the policy asks it nothing, the same greedy output either way, and a model
that cannot be opened then leaves decoding going without it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

import tandem.runtime.speculative.drafter_model as drafter_model
import tandem.runtime.speculative.factory as factory
from tandem.errors import TandemError
from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.backends.deferred import DeferredBackend
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_config import LlamaConfig
from tandem.runtime.engine.builder import open_engine
from tandem.runtime.engine.spec import EngineSpec
from tandem.runtime.generate import DoneEvent, autoregressive, generate
from tandem.runtime.speculative.cost import CostCurve
from tandem.runtime.speculative.cost_cache import DrafterCosts, times_drafter_call
from tandem.runtime.speculative.drafter_model import open_model_drafter
from tandem.runtime.speculative.drafters.model import ModelDrafter
from tandem.runtime.speculative.factory import SpecOptions, build_strategy
from tandem.runtime.speculative.policy.adaptive import AdaptivePolicy

ONE_THREAD = LlamaConfig(n_ctx=512, n_threads=1)
PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play"


def greedy(target, strategy, n: int = 32) -> DoneEvent:
    ids = target.tokenize(PROMPT, add_bos=True)
    *_, done = generate(target, ids, Sampler(SamplingParams.greedy_params()), strategy=strategy, max_tokens=n,
                        stop_at_eog=False)
    assert isinstance(done, DoneEvent)
    return done


@pytest.fixture()
def target(stories260k: Path):
    backend = LlamaCppBackend(stories260k, ONE_THREAD)
    yield backend
    backend.close()


def deferred(path: Path, opener=None, check=None) -> tuple[DeferredBackend, list[str]]:
    opened: list[str] = []

    def open_it():
        opened.append(path.name)
        return opener() if opener else LlamaCppBackend(path, ONE_THREAD)

    return DeferredBackend(path, n_ctx=512, weights=path.stat().st_size, opener=open_it, check=check), opened


def test_the_model_opens_at_the_first_draft_and_the_output_is_plain_greedy(target, stories260k: Path) -> None:
    backend, opened = deferred(stories260k)
    drafter = open_model_drafter(target, backend, "model")
    assert isinstance(drafter, ModelDrafter) and opened == []  # building the drafter loads nothing
    assert backend.memory().total == 0 and backend.tokens == [] and drafter.backlog([1, 2, 3]) == 2
    strategy = build_strategy(target, backend, SpecOptions(mode="model", draft_length=4, measure_cost=False))
    assert opened == []
    done = greedy(target, strategy)
    assert opened == [stories260k.name]  # once, at the first draft
    assert done.stats.drafted_tokens > 0 and done.stats.accepted_tokens == done.stats.drafted_tokens  # itself
    assert done.tokens == greedy(target, autoregressive).tokens
    assert strategy.describe()["drafter_loaded"] is True and backend.memory().weights > 0
    strategy.close()
    backend.close()
    with pytest.raises(TandemError, match="closed"):
        backend.evaluate([1])


def test_a_drafter_the_policy_never_asks_is_never_opened(target, stories260k: Path) -> None:
    """Drafting that costs 50 target steps a token never pays: the model stays on disk."""
    backend, opened = deferred(stories260k)
    strategy = build_strategy(target, backend, SpecOptions(mode="auto", draft_cost=50.0, measure_cost=False))
    done = greedy(target, strategy, n=48)
    assert opened == [] and strategy.describe()["drafter_loaded"] is False
    assert done.tokens == greedy(target, autoregressive, n=48).tokens
    strategy.close()


def test_a_model_that_fails_to_open_leaves_decoding_going(target, stories260k: Path) -> None:
    def gone():
        raise TandemError("No such file: drafter.gguf")

    backend, opened = deferred(stories260k, opener=gone)
    strategy = build_strategy(target, backend, SpecOptions(mode="model", draft_length=4, measure_cost=False))
    done = greedy(target, strategy)
    assert opened == [stories260k.name]  # tried once, not every round
    assert done.tokens == greedy(target, autoregressive).tokens and done.stats.drafted_tokens == 0
    info = strategy.describe()
    assert info["drafter_loaded"] is False and "could not be loaded: No such file" in info["drafter_error"]
    strategy.close()


def test_a_model_with_another_vocabulary_is_closed_and_not_used(target, stories260k: Path,
                                                                 tinystories656k_gguf: Path) -> None:
    """The vocabularies are compared when the model opens (the cost learnt under a
    same-vocabulary name could be an older file's): a mismatch drafts nothing."""
    def check(opened_backend) -> None:
        if not drafter_model.same_vocabulary(target, opened_backend):
            raise drafter_model.DrafterUnavailable("another vocabulary")

    backend, opened = deferred(tinystories656k_gguf, check=check)
    strategy = build_strategy(target, backend, SpecOptions(mode="model", draft_length=4, measure_cost=False))
    done = greedy(target, strategy)
    assert opened == [tinystories656k_gguf.name] and not backend.is_open  # opened, found wrong, closed
    assert done.tokens == greedy(target, autoregressive).tokens and done.stats.drafted_tokens == 0
    strategy.close()


@pytest.mark.parametrize("draft_cost, asked", [(50.0, False), (0.05, True)])
def test_the_engine_defers_a_drafter_whose_costs_are_known(stories_twin: Path, stories260k: Path, monkeypatch,
                                                           draft_cost: float, asked: bool) -> None:
    """Costs learnt before (here: given) make the engine stand the drafter in; it opens
    only where the policy asks for a draft, and the reply is plain greedy either way."""
    learnt: list[str] = []

    def cached(target, name: str, weights: int, **_) -> DrafterCosts:
        learnt.append(name)
        return DrafterCosts(draft_cost, None, draft_cost)

    for module in (factory, drafter_model):
        monkeypatch.setattr(module, "cached_drafter_costs", cached)
    spec = EngineSpec(stories_twin, stories260k, threads=1, n_ctx=512)
    stages: list[str] = []
    with open_engine(spec, notify=stages.append) as engine:
        assert isinstance(engine.drafter_backend, DeferredBackend) and not engine.drafter_backend.is_open
        assert learnt and learnt[0] == f"model:{stories260k.stem}" and "loading the drafter" not in stages
        done = greedy(engine.target, engine.strategy, n=48)
        assert engine.drafter_backend.is_open is asked
    with open_engine(EngineSpec(stories_twin, threads=1, n_ctx=512, draft_mode="off")) as plain:
        assert greedy(plain.target, plain.strategy, n=48).tokens == done.tokens


@pytest.mark.parametrize("given, learnt, step_s, timed", [
    (None, None, 0.05, True),  # nothing known, the target's step known: the guess times a call
    (None, None, None, False),  # no step to compare with (a target never timed)
    (0.3, None, 0.05, False),  # --draft-cost given
    (None, DrafterCosts(0.3), 0.05, False),  # a draft cost learnt before
    (None, DrafterCosts(None, None, 0.2), 0.05, False),  # a call timed before
    (None, DrafterCosts(None, 0.1), 0.05, True),  # only its catch-up known
])
def test_the_cost_guess_times_a_drafter_call_only_when_nothing_knows_its_cost(
        given: float | None, learnt: DrafterCosts | None, step_s: float | None, timed: bool) -> None:
    assert times_drafter_call(given, learnt, step_s) is timed


def test_a_drafter_whose_call_the_cost_guess_times_opens_with_the_engine(stories_twin: Path, stories260k: Path,
                                                                        monkeypatch) -> None:
    """The target's cost curve is cached and nothing is known of the drafter: building the
    strategy times one call of its model, so the engine opens it at once (and the cost
    guess took that call)."""
    curve = CostCurve.linear(0.3, 8, t1_s=0.05)  # measured: a prior's step (t1_s 0) times nothing
    for module in (factory, drafter_model):
        monkeypatch.setattr(module, "cached_cost_curve", lambda target, k_max=8, **_: curve)
    timed: list[float | None] = []

    def call_cost(model_drafter, target_step_s):
        timed.append(target_step_s)
        return real_call_cost(model_drafter, target_step_s)

    real_call_cost = factory.drafter_call_cost
    monkeypatch.setattr(factory, "drafter_call_cost", call_cost)
    with open_engine(EngineSpec(stories_twin, stories260k, threads=1, n_ctx=512)) as engine:
        assert isinstance(engine.drafter_backend, LlamaCppBackend)
        assert timed == [0.05]  # one call of the open model, against the cached step
        policy = engine.strategy.policy
        assert isinstance(policy, AdaptivePolicy) and policy.draft_cost_guessed


def test_only_a_drafter_storing_the_targets_vocabulary_is_deferred(stories_twin: Path, stories260k: Path,
                                                                  tinystories656k_gguf: Path) -> None:
    """A fresh data folder (nothing timed yet) defers a same-vocabulary drafter too; a
    cross-vocabulary one builds its translation from both vocabularies, so it opens now."""
    from tandem.models.gguf_file import inspect_gguf

    assert inspect_gguf(stories_twin).vocabulary() == inspect_gguf(stories260k).vocabulary() is not None
    assert inspect_gguf(tinystories656k_gguf).vocabulary() != inspect_gguf(stories260k).vocabulary()
    with open_engine(EngineSpec(stories_twin, stories260k, threads=1, n_ctx=512)) as engine:
        assert isinstance(engine.drafter_backend, DeferredBackend) and not engine.drafter_backend.is_open
    with open_engine(EngineSpec(stories260k, tinystories656k_gguf, threads=1, n_ctx=512)) as engine:
        assert isinstance(engine.drafter_backend, LlamaCppBackend)
        assert f"xvocab-text:{tinystories656k_gguf.stem}" in engine.strategy.describe()["drafter"]


def test_on_the_real_pair_a_drafter_opened_mid_reply_keeps_the_output_plain_greedy(real_models, monkeypatch) -> None:
    """The 0.5B opened by the first round that asks it (a cheap cost stands in for the
    learnt one, so the policy does ask), then drafting for the quantized 1.5B: the reply
    is the 1.5B's plain greedy reply token for token."""
    for module in (factory, drafter_model):
        monkeypatch.setattr(module, "cached_drafter_costs", lambda *a, **k: DrafterCosts(0.05, None, 0.05))
    prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    spec = EngineSpec(real_models.qwen_15b, real_models.qwen_05b, threads=2, n_ctx=512)

    def reply(engine) -> DoneEvent:
        ids = engine.target.tokenize(prompt)
        *_, done = generate(engine.target, ids, Sampler(SamplingParams.greedy_params()), strategy=engine.strategy,
                            max_tokens=40, stop_at_eog=False)
        return done

    with open_engine(spec) as engine:
        assert isinstance(engine.drafter_backend, DeferredBackend) and not engine.drafter_backend.is_open
        spec_done = reply(engine)
        assert engine.drafter_backend.is_open and spec_done.stats.accepted_tokens > 0
    with open_engine(replace(spec, draft_mode="off")) as plain:
        assert reply(plain).tokens == spec_done.tokens
