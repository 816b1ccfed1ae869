"""Verification of a draft against the target: the lossless speculative acceptance rule.

Pure functions on arrays (no model, no I/O), so the rule can be tested statistically on
toy distributions and reused by every drafter.

* Greedy: accept while the target's choice equals the drafted token; at the first
  mismatch emit the target's choice; if all match, emit the target's next choice.
  The output is token-for-token the target's greedy output.
* Sampling (Leviathan et al. 2023; Chen et al. 2023): accept drafted ``x_i`` with
  probability ``min(1, p_i(x_i) / q_i(x_i))``; on the first rejection emit a sample of
  the residual ``norm(max(0, p_i - q_i))`` and stop; if all are accepted emit a sample
  of ``p_{k+1}``. Every emitted token then follows the target distribution exactly,
  for any proposal ``q``. ``q = None`` means the proposal was deterministic (one-hot on
  the drafted token), as for prompt lookup and suffix drafters.

Randomness enters only through explicit uniforms (``u`` for accept/reject, ``v`` for the
inverse-CDF draw), so the functions are deterministic given their inputs and the
batched form used by tests is the same arithmetic as the per-round form.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one draft."""

    accepted: int
    """How many drafted tokens were accepted (a prefix of the draft)."""
    token: int
    """The token emitted after them: the correction on a rejection, else the bonus token."""

    @property
    def tokens_emitted(self) -> int:
        return self.accepted + 1


def inverse_cdf(probs: np.ndarray, v: np.ndarray | float) -> np.ndarray:
    """Draw from each row of ``probs`` (shape ``(..., V)``) with uniforms ``v`` in [0, 1).

    Unnormalized rows are fine (the draw scales by the row sum). The result never
    lands on a zero-probability index, even at ``v`` close to 1.
    """
    probs = np.asarray(probs, dtype=np.float64)
    cdf = np.cumsum(probs, axis=-1)
    target = np.asarray(v, dtype=np.float64)[..., None] * cdf[..., -1:]
    idx = np.sum(cdf <= target, axis=-1)
    idx = np.minimum(idx, probs.shape[-1] - 1)
    # Guard against float round-off at the top end landing on a trailing zero.
    last_nonzero = probs.shape[-1] - 1 - np.argmax(probs[..., ::-1] > 0, axis=-1)
    return np.minimum(idx, last_nonzero)


def acceptance_ratio(p_x: np.ndarray, q_x: np.ndarray | None) -> np.ndarray:
    """``min(1, p(x)/q(x))`` elementwise; ``q_x=None`` means q(x) = 1 (one-hot proposal).

    ``q(x) = 0`` cannot happen when x was drawn from q; if a drafter reports it anyway
    the token is accepted iff the target gives it any probability, which keeps the
    output on the target's support.
    """
    p_x = np.asarray(p_x, dtype=np.float64)
    if q_x is None:
        return np.minimum(1.0, p_x)
    q_x = np.asarray(q_x, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(q_x > 0, p_x / np.where(q_x > 0, q_x, 1.0), np.where(p_x > 0, 1.0, 0.0))
    return np.minimum(1.0, ratio)


def residual(p: np.ndarray, q: np.ndarray | None, x: np.ndarray | int) -> np.ndarray:
    """The (unnormalized) residual ``max(0, p - q)`` of each row, never all-zero.

    ``q=None`` is one-hot on ``x``: the residual is p with ``x`` removed. When the
    residual vanishes (p == q up to round-off, so a rejection had probability ~0) the
    row falls back to p, which is the correct limit and never yields NaN.
    """
    p = np.asarray(p, dtype=np.float64)
    if q is None:
        res = p.copy()
        rows = np.arange(res.shape[0]) if res.ndim == 2 else None
        if rows is None:
            res[int(x)] = 0.0
        else:
            res[rows, np.asarray(x)] = 0.0
    else:
        res = np.maximum(0.0, p - np.asarray(q, dtype=np.float64))
    mass = res.sum(axis=-1, keepdims=True)
    return np.where(mass > 1e-12, res, p)


def speculative_step(
    p: np.ndarray, q: np.ndarray | None, x: np.ndarray, u: np.ndarray, v: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """One position of the rejection rule for a batch of independent trials.

    ``p``/``q``: ``(B, V)`` target / proposal rows (``q=None``: one-hot on ``x``);
    ``x``: ``(B,)`` drafted tokens; ``u``, ``v``: ``(B,)`` uniforms. Returns
    ``(accepted, token)``: whether ``x`` was accepted and the token that position
    emits (``x`` if accepted, else a residual sample).
    """
    rows = np.arange(p.shape[0])
    x = np.asarray(x)
    ratio = acceptance_ratio(p[rows, x], None if q is None else q[rows, x])
    accepted = np.asarray(u) < ratio
    corrected = inverse_cdf(residual(p, q, x), v)
    return accepted, np.where(accepted, x, corrected)


def verify_greedy(draft: Sequence[int], target_choices: Sequence[int]) -> Verdict:
    """Greedy verification: ``target_choices[i]`` is the target's argmax after ``i``
    accepted draft tokens (``len(draft) + 1`` entries, or fewer if computed lazily up
    to the first mismatch)."""
    n = 0
    while n < len(draft) and draft[n] == target_choices[n]:
        n += 1
    return Verdict(n, int(target_choices[n]))


def verify_sampled(
    draft: Sequence[int],
    p: np.ndarray,
    q: np.ndarray | None,
    rng: np.random.Generator,
) -> Verdict:
    """The standard rejection rule over a whole draft.

    ``p``: ``(k+1, V)`` target distributions (row ``i`` follows ``i`` accepted
    tokens); ``q``: ``(k, V)`` proposal distributions or ``None`` (deterministic
    draft). Draws ``k`` accept uniforms at once, then one uniform for the emitted token.
    """
    k = len(draft)
    if p.shape[0] < k + 1:
        raise ValueError(f"need {k + 1} target rows for a draft of {k}, got {p.shape[0]}")
    if k:
        x = np.asarray(draft, dtype=np.int64)
        rows = np.arange(k)
        ratio = acceptance_ratio(p[rows, x], None if q is None else q[rows, x])
        rejected = np.flatnonzero(rng.random(k) >= ratio)
        if rejected.size:
            i = int(rejected[0])
            res = residual(p[i : i + 1], None if q is None else q[i : i + 1], x[i : i + 1])
            return Verdict(i, int(inverse_cdf(res, np.array([rng.random()]))[0]))
    return Verdict(k, int(inverse_cdf(p[k : k + 1], np.array([rng.random()]))[0]))


def expected_tokens(acceptance: float | Sequence[float] | np.ndarray, k: int) -> float:
    """Tokens a round of ``k`` drafts yields: the accepted prefix plus the target's own
    token, E = 1 + sum_j prod_{i<=j} a_i. ``acceptance``: one rate for every position
    (then E = (1 - a^(k+1)) / (1 - a)), or one per position. The one formula the planner,
    the placement and the adaptive policy all price speculation with."""
    if np.ndim(acceptance) == 0:
        a = float(acceptance)
        return k + 1.0 if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)
    return expected_tokens_upto(acceptance, k)[-1]


def expected_tokens_upto(acceptance: Sequence[float] | np.ndarray, n: int) -> list[float]:
    """:func:`expected_tokens` for every length ``k = 0..n`` at once, per-position rates
    (positions past ``acceptance`` add nothing): an adaptive policy prices every length
    of every draft each round, so this is one pass in plain floats (numpy's per-call
    overhead on 32 numbers was most of its cost)."""
    out = [1.0]
    reach = 1.0  # P(the first j drafts accepted)
    for a in np.asarray(acceptance, dtype=np.float64)[:n].tolist():
        reach *= a
        out.append(out[-1] + reach)
    return out + [out[-1]] * (n + 1 - len(out))
