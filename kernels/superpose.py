"""Superposed Decoding as pure array functions (Shen et al., NeurIPS 2024; arXiv 2405.18400).

k drafts share one forward pass per step: the model's input is a convex mix of the k
drafts' last-token embeddings, weighted by how likely each draft is. The model's single
next-token distribution is then re-scored per draft with an n-gram model (which *does*
see each draft's own context) and the k x top-m candidates are pruned back to k.

Everything here is a pure function on numpy arrays so it can be tested exactly; the
loop that calls the model lives in :mod:`tandem.runtime.autocomplete.superposed`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

DEFAULT_NGRAM_WEIGHTS = (0.01, 0.04, 0.15, 0.18, 0.12)
"""Interpolation weights for n-gram contexts of length 1..5 (the paper's ``geom`` setting)."""


@dataclass(frozen=True)
class SuperposeConfig:
    """Knobs of superposed decoding; the defaults are the paper's."""

    temperature: float = 0.06
    """Temperature of the shared LM proposal (low: the drafts stay on likely tokens)."""
    top_m: int = 9
    """Candidate tokens kept from the LM proposal per step (``n_token_sample``)."""
    alpha: float = 0.54
    """Weight of the n-gram score against the LM score."""
    penalty: float = 200.0
    """Subtracted from a candidate the n-gram model has never seen after this draft."""
    ngram_weights: tuple[float, ...] = field(default=DEFAULT_NGRAM_WEIGHTS)


def mixing_weights(draft_logp: np.ndarray, last_tokens: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """The sparse mixing vector m: (distinct last tokens, their pooled weights).

    Draft weights are ``softmax(draft_logp)`` (w_i ∝ exp(logp_i)); drafts that end in the
    same token pool their weight on it. The result is non-negative, sums to one and has
    at most k entries. ``-inf`` log-probs get zero weight (a dead draft).
    """
    logp = np.asarray(draft_logp, dtype=np.float64)
    if logp.ndim != 1 or len(logp) != len(last_tokens) or len(logp) == 0:
        raise ValueError("need one log-probability per draft and at least one draft")
    finite = np.isfinite(logp)
    if not finite.any():
        w = np.full(len(logp), 1.0 / len(logp))
    else:
        shifted = np.where(finite, logp - logp[finite].max(), -np.inf)
        w = np.exp(shifted)
        w /= w.sum()
    tokens, inverse = np.unique(np.asarray(last_tokens, dtype=np.int64), return_inverse=True)
    pooled = np.zeros(len(tokens), dtype=np.float64)
    np.add.at(pooled, inverse, w)
    keep = pooled > 0
    tokens, pooled = tokens[keep], pooled[keep]
    return tokens, pooled / pooled.sum()


def superposed_embedding(tokens: np.ndarray, weights: np.ndarray, embeddings: np.ndarray) -> np.ndarray:
    """m · E = Σ_i w_i E[tok_i]: the one input row every draft shares this step."""
    rows = np.asarray(embeddings[np.asarray(tokens, dtype=np.int64)], dtype=np.float64)
    return (np.asarray(weights, dtype=np.float64) @ rows).astype(np.float32)


def top_ids(x: np.ndarray, m: int) -> np.ndarray:
    """The ``m`` largest entries' ids, largest first, ties by lower id: the first ``m`` of a
    full stable sort, found by partitioning (O(V)) and sorting only the candidates that
    reach the m-th value (a sort of a 151,936-entry vocabulary cost ~15 ms a step)."""
    if m >= x.shape[-1]:
        return np.lexsort((np.arange(x.shape[-1]), -x))
    kth = np.partition(x, x.shape[-1] - m)[x.shape[-1] - m]
    cand = np.flatnonzero(x >= kth)
    return cand[np.lexsort((cand, -x[cand]))][:m]


def lm_proposal(logits: np.ndarray, temperature: float, top_m: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-m tokens of softmax(logits / T), renormalized over those m: (tokens, log-probs).

    Ties are broken by token id (lower first), like ``np.argmax``, so k = 1 with α = 0
    reproduces greedy decoding exactly.
    """
    x = np.asarray(logits, dtype=np.float64)
    m = max(1, min(top_m, x.shape[-1]))
    order = top_ids(x, m)
    z = x[order] / max(temperature, 1e-6)
    z -= z.max()
    logp = z - np.log(np.exp(z).sum())
    return order.astype(np.int64), logp


def combine_scores(
    lm_logp: np.ndarray, ngram_prob: np.ndarray | None, alpha: float, penalty: float
) -> np.ndarray:
    """Per-draft candidate scores s_i(t) = (1-α)·log p(t) + α·log p_ng,i(t).

    ``lm_logp`` has shape (m,), shared by all drafts; ``ngram_prob`` has shape (k, m).
    A candidate the n-gram model gives no support after draft i scores
    (1-α)·log p(t) − penalty instead of −inf, so a draft out of the n-gram model's
    reach still ranks its candidates by the LM (the paper applies this per draft; per
    candidate is the same when a draft has no support at all, and never gives −inf).
    With no n-gram model (``None``) or α = 0 the score is the LM's alone.
    """
    lm = np.asarray(lm_logp, dtype=np.float64)[None, :]
    if ngram_prob is None or alpha == 0.0:
        k = 1 if ngram_prob is None else ngram_prob.shape[0]
        return np.repeat(lm, k, axis=0)
    ng = np.asarray(ngram_prob, dtype=np.float64)
    with np.errstate(divide="ignore"):
        log_ng = np.log(ng)
    supported = ng > 0
    return np.where(supported, (1 - alpha) * lm + alpha * log_ng, (1 - alpha) * lm - penalty)


@dataclass(frozen=True)
class Expansion:
    """Candidates kept by one expand-and-prune step."""

    parents: np.ndarray
    """Index of the draft each kept candidate extends."""
    tokens: np.ndarray
    scores: np.ndarray
    """Cumulative scores (draft log-prob + step score)."""
    finished: np.ndarray
    """Boolean: the kept candidate ends in an end-of-generation token."""


def expand_and_prune(
    draft_logp: np.ndarray,
    step_scores: np.ndarray,
    cand_tokens: np.ndarray,
    keep: int,
    eog: frozenset[int] | set[int] = frozenset(),
) -> Expansion:
    """Best ``keep`` (draft, token) pairs by cumulative score over k × m candidates.

    Each pair extends a distinct draft with a distinct token, so drafts that were
    distinct stay distinct. Ties go to the lower draft index, then the earlier candidate
    (the LM's order), which keeps the step deterministic.
    """
    total = np.asarray(draft_logp, dtype=np.float64)[:, None] + np.asarray(step_scores, dtype=np.float64)
    flat = total.ravel()
    n = min(keep, int(np.isfinite(flat).sum()) or len(flat))
    order = np.lexsort((np.arange(len(flat)), -flat))[:n]
    parents, cols = np.divmod(order, total.shape[1])
    tokens = np.asarray(cand_tokens, dtype=np.int64)[cols]
    finished = np.array([int(t) in eog for t in tokens], dtype=bool)
    return Expansion(parents=parents, tokens=tokens, scores=flat[order], finished=finished)


def perplexity(token_logp: Sequence[float]) -> float:
    """exp of the mean negative log-likelihood; ``inf`` for an empty sequence."""
    if len(token_logp) == 0:
        return float("inf")
    return float(np.exp(-np.mean(np.asarray(token_logp, dtype=np.float64))))


def distinct_n(drafts: Sequence[Sequence[int]], n: int = 2) -> float:
    """Distinct-n: unique n-grams over all n-grams across the drafts (1.0 = no overlap)."""
    grams = [tuple(d[i : i + n]) for d in drafts for i in range(len(d) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0
