"""Drafting from a predicted output (OpenAI's ``prediction``).

The walk through the prediction is checked against a brute-force reference written
independently of the n-gram index; decoding with a prediction is checked token for token
against plain decoding (greedy and seeded), whatever the prediction says.
"""

from __future__ import annotations

import numpy as np
import pytest

from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_config import LlamaConfig
from tandem.runtime.generate import DoneEvent, autoregressive, generate
from tandem.runtime.speculative.cost import CostCurve, OnlineCost
from tandem.runtime.speculative.drafters.lookup import PromptLookupDrafter
from tandem.runtime.speculative.drafters.prediction import Prediction, PredictionDrafter
from tandem.runtime.speculative.factory import SpecOptions, SpeculativeStrategy, build_strategy
from tandem.runtime.speculative.policy.base import FixedLength

GREEDY = Sampler(SamplingParams.greedy_params())


def reference_walk(pred: list[int], reply: list[int], min_n: int = 2, max_n: int = 6) -> tuple[int | None, int]:
    """Brute force: (where the reply stands in ``pred`` after it, how many of ``pred``'s
    tokens it met), scanning the whole prediction at every departure."""
    at: int | None = 0
    furthest, seen = 0, set()
    for i, t in enumerate(reply):
        if at is not None and at < len(pred) and pred[at] == t:
            seen.add(at)
            at += 1
            furthest = max(furthest, at)
            continue
        at = None
        for n in range(min(max_n, i + 1), min_n - 1, -1):
            tail = reply[i + 1 - n:i + 1]
            ends = [s + n for s in range(len(pred) - n + 1) if pred[s:s + n] == tail]
            if ends:
                later = [e for e in ends if e >= furthest]
                at = later[0] if later else ends[-1]
                seen.update(range(at - n, at))
                furthest = max(furthest, at)
                break
    return at, len(seen)


@pytest.mark.parametrize("seed", range(8))
def test_the_walk_matches_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    pred = [int(t) for t in rng.integers(0, 6, 80)]
    # A reply that copies stretches of the prediction, with edits between them.
    reply: list[int] = []
    while len(reply) < 90:
        if rng.random() < 0.6:
            start = int(rng.integers(0, len(pred)))
            reply += pred[start:start + int(rng.integers(2, 12))]
        else:
            reply += [int(t) for t in rng.integers(0, 9, int(rng.integers(1, 4)))]
    prediction = Prediction(pred)
    for end in range(len(reply) + 1):
        at, met = reference_walk(pred, reply[:end])
        assert prediction.walk(reply[:end]).at == at
        assert prediction.appeared(reply[:end]) == met


def test_a_reply_that_is_the_prediction_is_drafted_whole_from_its_start() -> None:
    pred = list(range(100, 140))
    drafter = PredictionDrafter(Prediction(pred), reply_start=5)
    prompt = [1, 2, 3, 4, 5]
    assert drafter.propose(prompt, 8, GREEDY).tokens == pred[:8]
    context = prompt + pred[:9]  # a round: 8 accepted and the target's own next token
    drafter.commit(context, 8)
    draft = drafter.propose(context, 8, GREEDY)
    assert draft.tokens == pred[9:17] and draft.source == "prediction"
    assert Prediction(pred).appeared(pred) == len(pred)


def test_after_an_edit_the_reply_is_found_again_in_the_prediction() -> None:
    before, after = list(range(100, 130)), list(range(200, 240))
    edit = [900, 901, 902]  # tokens the prediction does not have
    drafter = PredictionDrafter(Prediction(before + list(range(300, 305)) + after), reply_start=0)
    reply = before + edit
    drafter.commit(reply, 0)
    assert drafter.propose(reply, 4, GREEDY).tokens == []  # departed: the other drafters' turn
    reply += after[:2]  # two tokens of what follows the edit in the prediction
    drafter.commit(reply, 0)
    assert drafter.propose(reply, 4, GREEDY).tokens == after[2:6]
    # OpenAI's usage: the prediction's tokens the reply met, the rest rejected.
    assert Prediction(before + list(range(300, 305)) + after).appeared(before + edit + after) == 30 + 40


def test_a_pre_draft_past_the_commits_does_not_move_the_drafter() -> None:
    pred = list(range(100, 140))
    drafter = PredictionDrafter(Prediction(pred), reply_start=0)
    assert drafter.propose(pred[:10], 4, GREEDY).tokens == pred[10:14]  # assumed, not committed
    assert drafter.propose([7, 7, 7], 4, GREEDY).tokens == []  # what was committed instead
    drafter.commit(pred[:3], 2)
    assert drafter.propose(pred[:3], 4, GREEDY).tokens == pred[3:7]


def test_drafts_are_believed_as_often_as_the_reply_followed_the_prediction() -> None:
    """The confidence is measured on the reply: a copy keeps it near 1, a reply that
    departs every few tokens (a rewrite renaming every name) brings it down."""
    rng = np.random.default_rng(3)
    pred = [int(t) for t in rng.integers(100, 10_000, 120)]
    copy = PredictionDrafter(Prediction(pred), reply_start=0)
    copy.commit(pred[:100], 0)
    assert copy.follow_rate() > 0.98
    assert copy.propose(pred[:100], 4, GREEDY).confidence == [copy.follow_rate()] * 4

    renamed = [t if i % 4 else 99 for i, t in enumerate(pred)]  # every 4th token another name
    rewrite = PredictionDrafter(Prediction(pred), reply_start=0)
    rewrite.commit(renamed[:100], 0)
    assert 0.4 < rewrite.follow_rate() < 0.8
    draft = rewrite.propose(renamed[:100], 4, GREEDY)
    assert draft.tokens == pred[100:104] and draft.confidence == [rewrite.follow_rate()] * 4


ONE_THREAD = LlamaConfig(n_ctx=512, n_threads=1)
N_TOKENS = 96


@pytest.fixture()
def stories_target(stories260k):
    backend = LlamaCppBackend(stories260k, ONE_THREAD)
    yield backend
    backend.close()


def _decode(target, prompt: list[int], strategy, sampling: dict) -> DoneEvent:
    *_, done = generate(target, prompt, Sampler(SamplingParams(**sampling)), strategy=strategy,
                        max_tokens=N_TOKENS, stop_at_eog=False)
    assert isinstance(done, DoneEvent)
    return done


def _predictions(plain: list[int], rng: np.random.Generator, n_vocab: int) -> dict[str, list[int]]:
    """What a client may predict: the reply itself, the reply with an edit in its middle
    (a stretch replaced, one dropped), the reply's second half only, and noise."""
    third = len(plain) // 3
    noise = [int(t) for t in rng.integers(3, n_vocab, len(plain))]
    return {"exact": plain, "edited": plain[:third] + noise[:5] + plain[third + 8:],
            "late": plain[len(plain) // 2:], "noise": noise}


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.8, "seed": 5}])
def test_decoding_with_any_prediction_is_plain_decoding(stories_target, sampling) -> None:
    """Greedy and seeded: the reply is the plain reply token for token, whatever the
    prediction says; a right prediction is accepted, and costs a third of the target calls."""
    target = stories_target
    rng = np.random.default_rng(0)
    strategy = SpeculativeStrategy(PromptLookupDrafter(), FixedLength(6))
    for text in ("Once upon a time", "Lily saw a big dog. The dog"):
        prompt = target.tokenize(text, add_bos=True)
        plain = _decode(target, prompt, autoregressive, sampling)
        for kind, tokens in _predictions(plain.tokens, rng, target.n_vocab).items():
            done = _decode(target, prompt, strategy.predicting(Prediction(tokens), len(prompt)), sampling)
            assert done.tokens == plain.tokens, (text, kind)
            if kind == "exact":
                assert done.stats.accepted_tokens >= len(plain.tokens) - 2 * (N_TOKENS // 6)
                assert done.stats.target_calls < len(plain.tokens) / 3


def test_the_adaptive_strategy_speculates_from_a_prediction_and_keeps_its_drafter(stories_target) -> None:
    """``tandem serve``'s strategy (model-free drafters, adaptive lengths): the prediction
    joins its drafters for one reply, trusted on its own even where the suffix tree's and
    lookup's drafts failed in the replies before; closing that reply's strategy leaves the
    lane's drafters open."""
    target = stories_target
    strategy = build_strategy(target, None, SpecOptions(measure_cost=False, suffix_memory="request"))
    prompt = target.tokenize("The little dog", add_bos=True)
    plain = _decode(target, prompt, autoregressive, {"temperature": 0.0})
    before = _decode(target, prompt, strategy, {"temperature": 0.0})
    assert before.tokens == plain.tokens and before.stats.accepted_tokens < 0.25 * len(plain.tokens)
    predicted = strategy.predicting(Prediction(plain.tokens), len(prompt))
    done = _decode(target, prompt, predicted, {"temperature": 0.0})
    assert done.tokens == plain.tokens
    assert done.stats.accepted_tokens > 0.8 * len(plain.tokens)
    assert done.stats.target_calls < len(plain.tokens) / 4
    predicted.close()
    assert strategy.drafter is not None
    assert _decode(target, prompt, strategy, {"temperature": 0.0}).tokens == plain.tokens
    strategy.close()
    off = build_strategy(target, None, SpecOptions(mode="off"))
    assert off.predicting(Prediction(plain.tokens), len(prompt)) is off  # plain stays plain


def test_wrong_predictions_before_do_not_silence_a_right_one(stories_target) -> None:
    """A server slot keeps its strategy from request to request: replies whose predictions
    were noise taught its policy that "prediction" drafts fail, and a later right
    prediction was then never verified (drafted 0 of 28 tokens after 80 requests). Each
    reply's prediction is judged afresh (verify costs given, not timed: a toy's timed calls
    on a loaded box could price any draft out)."""
    target = stories_target
    rng = np.random.default_rng(1)
    strategy = build_strategy(target, None, SpecOptions(measure_cost=False, suffix_memory="request"))
    strategy.policy.cost = OnlineCost(CostCurve.linear(0.5), measure_t1=False, learn=False)
    prompt = target.tokenize("The little dog", add_bos=True)
    plain = _decode(target, prompt, autoregressive, {"temperature": 0.0})
    for _ in range(6):
        noise = [int(t) for t in rng.integers(3, target.n_vocab, len(plain.tokens))]
        wrong = strategy.predicting(Prediction(noise), len(prompt))
        assert _decode(target, prompt, wrong, {"temperature": 0.0}).tokens == plain.tokens
        wrong.close()
    right = strategy.predicting(Prediction(plain.tokens), len(prompt))
    done = _decode(target, prompt, right, {"temperature": 0.0})
    assert done.tokens == plain.tokens and done.stats.accepted_tokens > 0.85 * len(plain.tokens)  # 61 of 96 before
    right.close()
    strategy.close()
