"""Superposed decoding: the pure kernels, and the decoder on a real GGUF through llama.cpp."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.kernels.superpose import (
    SuperposeConfig,
    combine_scores,
    distinct_n,
    expand_and_prune,
    lm_proposal,
    mixing_weights,
    superposed_embedding,
    top_ids,
)
from tandem.models.ngram import NgramModel
from tandem.runtime.autocomplete.superposed import SuperposedDecoder
from tandem.runtime.generate import DoneEvent, generate

# -- kernels --------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.floats(-50, 0), st.integers(0, 6)), min_size=1, max_size=9),
)
def test_mixing_weights_are_a_sparse_distribution(drafts: list[tuple[float, int]]) -> None:
    logp = np.array([lp for lp, _ in drafts])
    last = [t for _, t in drafts]
    tokens, w = mixing_weights(logp, last)
    assert (w >= 0).all()
    assert w.sum() == pytest.approx(1.0, abs=1e-12)
    assert len(w) <= len(drafts)
    assert len(set(tokens.tolist())) == len(tokens)  # shared last tokens pooled
    # pooled weight of a token = sum over the drafts ending in it of softmax(logp)
    ref = np.exp(logp - logp.max())
    ref /= ref.sum()
    for tok, wt in zip(tokens, w, strict=True):
        assert wt == pytest.approx(ref[np.array(last) == tok].sum(), abs=1e-12)


def test_mixing_weights_pool_a_shared_last_token() -> None:
    tokens, w = mixing_weights(np.log([0.5, 0.3, 0.2]), [7, 3, 7])
    assert tokens.tolist() == [3, 7]
    assert w.tolist() == pytest.approx([0.3, 0.7])


def test_superposed_embedding_is_linear() -> None:
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(50, 16)).astype(np.float32)
    tokens, w = mixing_weights(np.array([-0.1, -1.3, -2.0]), [4, 9, 31])
    mixed = superposed_embedding(tokens, w, emb)
    expected = sum(float(wi) * emb[t].astype(np.float64) for t, wi in zip(tokens, w, strict=True))
    np.testing.assert_allclose(mixed, expected, rtol=1e-6, atol=1e-6)


def test_lm_proposal_keeps_top_m_and_renormalizes() -> None:
    logits = np.array([0.0, 3.0, 1.0, 3.0, -2.0])
    tokens, logp = lm_proposal(logits, temperature=1.0, top_m=3)
    assert tokens.tolist() == [1, 3, 2]  # tie broken by lower id, as argmax
    assert np.exp(logp).sum() == pytest.approx(1.0)
    z = logits[[1, 3, 2]]
    assert logp.tolist() == pytest.approx((z - np.log(np.exp(z).sum())).tolist())


def test_combine_scores_interpolates_and_penalizes() -> None:
    lm = np.log(np.array([0.6, 0.4]))
    ng = np.array([[0.2, 0.0], [0.0, 0.0]])
    s = combine_scores(lm, ng, alpha=0.5, penalty=200.0)
    assert s[0, 0] == pytest.approx(0.5 * np.log(0.6) + 0.5 * np.log(0.2))
    assert s[0, 1] == pytest.approx(0.5 * np.log(0.4) - 200.0)
    assert s[1].tolist() == pytest.approx((0.5 * lm - 200.0).tolist())
    # uniform n-gram tables: the ranking is the LM's alone
    uniform = combine_scores(lm, np.full((1, 2), 0.25), alpha=0.54, penalty=200.0)
    assert np.argsort(-uniform[0]).tolist() == np.argsort(-lm).tolist()


def test_expand_and_prune_keeps_distinct_best_pairs() -> None:
    draft_logp = np.array([-1.0, -2.0])
    scores = np.log(np.array([[0.5, 0.3, 0.2], [0.9, 0.05, 0.05]]))
    exp = expand_and_prune(draft_logp, scores, np.array([10, 11, 2]), keep=4, eog={2})
    total = draft_logp[:, None] + scores
    best = np.sort(total.ravel())[::-1][:4]
    assert exp.scores.tolist() == pytest.approx(best.tolist())
    pairs = list(zip(exp.parents.tolist(), exp.tokens.tolist(), strict=True))
    assert len(set(pairs)) == 4
    assert exp.finished.tolist() == [t == 2 for t in exp.tokens.tolist()]


def test_distinct_n() -> None:
    assert distinct_n([[1, 2, 3], [1, 2, 3]], 2) == pytest.approx(0.5)
    assert distinct_n([[1, 2, 3], [4, 5, 6]], 2) == 1.0


# -- decoder on a real model ----------------------------------------------------------


def _greedy(backend, prompt: list[int], n: int) -> list[int]:
    events = list(generate(backend, prompt, Sampler(SamplingParams.greedy_params()), max_tokens=n))
    done = events[-1]
    assert isinstance(done, DoneEvent)
    return done.tokens


def test_k1_alpha0_is_greedy(stories_backend) -> None:
    prompt = stories_backend.tokenize("Once upon a time", add_bos=True)
    greedy = _greedy(stories_backend, prompt, 30)
    decoder = SuperposedDecoder(stories_backend, None, SuperposeConfig(alpha=0.0))
    result = decoder.decode(prompt, k=1, max_tokens=30)
    assert result.drafts[0].tokens == greedy
    assert stories_backend.tokens == prompt  # the cache is rolled back to the prompt


def test_embedding_input_matches_token_input(stories_backend) -> None:
    """Linearity end to end: feeding E[t] through the embedding path equals feeding t."""
    prompt = stories_backend.tokenize("Lily saw a dog", add_bos=True)
    emb = stories_backend.token_embeddings()
    by_token = stories_backend.evaluate(prompt)[-1]
    stories_backend.truncate(0)
    by_embedding = stories_backend.evaluate_embeddings(emb[prompt])[-1]
    np.testing.assert_allclose(by_embedding, by_token, atol=1e-4)
    assert stories_backend.tokens == [-1] * len(prompt)


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_one_forward_pass_per_step_whatever_k(stories_backend, k: int) -> None:
    prompt = stories_backend.tokenize("One day, Tom", add_bos=True)
    decoder = SuperposedDecoder(stories_backend)
    calls = {"tokens": 0, "embeddings": 0}
    orig_eval, orig_embed = stories_backend.evaluate, stories_backend.evaluate_embeddings

    def count_eval(*a, **kw):
        calls["tokens"] += 1
        return orig_eval(*a, **kw)

    def count_embed(*a, **kw):
        calls["embeddings"] += 1
        return orig_embed(*a, **kw)

    stories_backend.evaluate, stories_backend.evaluate_embeddings = count_eval, count_embed
    result = decoder.decode(prompt, k=k, max_tokens=12)
    assert result.steps == 12
    assert calls["tokens"] == 2  # the prompt: all but its last token, then the last (backend.prefill)
    assert calls["embeddings"] == result.steps - 1  # one per step after the first
    assert result.forward_passes == 1 + calls["embeddings"]
    assert all(1 <= m <= k for m in result.mix_sizes)


@pytest.mark.parametrize("use_ngram", [False, True])
def test_drafts_are_distinct_and_ranked(stories_backend, use_ngram: bool) -> None:
    texts = ["Once upon a time, there was a little dog named Max. Max liked to run.",
             "Once upon a time, there was a big cat. The cat was sad."]
    ngram = NgramModel.build([stories_backend.tokenize(t, add_bos=True) for t in texts],
                             stories_backend.n_vocab) if use_ngram else None
    prompt = stories_backend.tokenize("Once upon a time", add_bos=True)
    result = SuperposedDecoder(stories_backend, ngram).decode(prompt, k=5, max_tokens=16)
    seqs = [tuple(d.tokens) for d in result.drafts]
    assert len(seqs) == 5
    assert len(set(seqs)) == 5
    scores = [d.score for d in result.drafts]
    assert scores == sorted(scores, reverse=True)


def test_draft_scores_never_rise(stories_backend) -> None:
    """Cumulative scores are sums of non-positive step scores: longer never scores higher."""
    prompt = stories_backend.tokenize("The sun", add_bos=True)
    decoder = SuperposedDecoder(stories_backend)
    prev = [d.score for d in decoder.decode(prompt, k=3, max_tokens=4).drafts]
    later = [d.score for d in decoder.decode(prompt, k=3, max_tokens=10).drafts]
    assert max(later) <= max(prev) + 1e-9


def test_deadline_and_cancel_stop_early(stories_backend) -> None:
    import threading

    prompt = stories_backend.tokenize("Once upon a time", add_bos=True)
    decoder = SuperposedDecoder(stories_backend)
    r = decoder.decode(prompt, k=3, max_tokens=50, deadline=0.0)
    assert r.stopped == "deadline" and r.steps == 1 and len(r.drafts) == 3
    cancel = threading.Event()
    cancel.set()
    r = decoder.decode(prompt, k=3, max_tokens=50, cancel=cancel)
    assert r.stopped == "cancelled" and r.steps == 1
    assert stories_backend.tokens == prompt


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-3, 3), min_size=1, max_size=80), st.integers(1, 90))
def test_top_ids_is_the_head_of_a_stable_full_sort(values: list[int], m: int) -> None:
    """Partition-then-sort equals the first m of a full sort by value, ties by lower id
    (what k = 1 relies on to reproduce greedy decoding), with many ties."""
    x = np.asarray(values, dtype=np.float64)
    m = min(m, len(values))
    want = np.lexsort((np.arange(len(x)), -x))[:m]
    assert top_ids(x, m).tolist() == want.tolist()
