"""Sampling as pure functions on logits, plus a small callable that chains them.

Every function takes and returns numpy arrays and has no hidden state, so speculative
acceptance can reuse exactly the distribution the sampler draws from
(:meth:`Sampler.distribution`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from tandem.kernels.sampling_params import SamplingParams


def apply_logit_bias(logits: np.ndarray, bias: Sequence[tuple[int, float]]) -> np.ndarray:
    """OpenAI's and llama.cpp's ``logit_bias``: each (token, value) adds ``value`` to that
    token's logit (``-inf`` bans it); a token listed twice gets both. Ids past the end of
    ``logits`` are not in this vocabulary (a drafter's shorter one): nothing to bias."""
    if not bias:
        return logits
    out = np.array(logits, dtype=np.float32, copy=True)
    ids = np.fromiter((t for t, _ in bias), dtype=np.int64, count=len(bias))
    values = np.fromiter((v for _, v in bias), dtype=np.float32, count=len(bias))
    inside = ids < out.shape[-1]
    np.add.at(out, ids[inside], values[inside])
    return out


def softmax(logits: np.ndarray) -> np.ndarray:
    """Numerically stable softmax over the last axis, in float64 for exact-sum tests."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - np.max(x, axis=-1, keepdims=True)
    e = np.exp(x)
    return e / np.sum(e, axis=-1, keepdims=True)


def apply_repetition_penalty(logits: np.ndarray, history: Sequence[int], penalty: float) -> np.ndarray:
    """CTRL-style penalty: divide positive, multiply negative logits of seen tokens."""
    if penalty == 1.0 or len(history) == 0:
        return logits
    out = np.array(logits, dtype=np.float32, copy=True)
    seen = np.unique(np.asarray(history, dtype=np.int64))
    vals = out[seen]
    out[seen] = np.where(vals > 0, vals / penalty, vals * penalty)
    return out


def apply_presence_frequency(logits: np.ndarray, history: Sequence[int], presence: float,
                             frequency: float) -> np.ndarray:
    """OpenAI's penalties, as llama.cpp applies them: a seen token's logit drops by
    ``presence`` once and by ``frequency`` for every time it was seen (negative values
    raise it)."""
    if (presence == 0.0 and frequency == 0.0) or len(history) == 0:
        return logits
    out = np.array(logits, dtype=np.float32, copy=True)
    seen, counts = np.unique(np.asarray(history, dtype=np.int64), return_counts=True)
    out[seen] -= (presence + frequency * counts).astype(np.float32)
    return out


def top_k_mask(logits: np.ndarray, k: int) -> np.ndarray:
    """Set all but the ``k`` largest logits to -inf (ties at the boundary are kept)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = np.partition(logits, -k)[-k]
    return np.where(logits >= kth, logits, -np.inf)


def top_p_filter(probs: np.ndarray, p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose mass reaches ``p``; renormalize."""
    if p >= 1.0:
        return probs
    support = np.flatnonzero(probs > 0)  # after top-k, a few dozen of 151,936: sort only those
    order = support[np.argsort(-probs[support], kind="stable")]
    cum = np.cumsum(probs[order])
    keep_n = int(np.searchsorted(cum, p, side="left")) + 1
    out = np.zeros_like(probs)
    kept = order[:keep_n]
    out[kept] = probs[kept]
    return out / out.sum()


def min_p_filter(probs: np.ndarray, min_p: float) -> np.ndarray:
    """Drop tokens less likely than ``min_p`` times the most likely one; renormalize."""
    if min_p <= 0.0:
        return probs
    out = np.where(probs >= min_p * probs.max(), probs, 0.0)
    return out / out.sum()


def greedy_distribution(logits: np.ndarray) -> np.ndarray:
    """One-hot on the argmax (first index on ties, as ``np.argmax``)."""
    out = np.zeros(logits.shape[-1], dtype=np.float64)
    out[int(np.argmax(logits))] = 1.0
    return out


_MASK64 = (1 << 64) - 1


def keyed_uniform(seed: int, position: int) -> float:
    """A uniform in [0, 1) that depends only on (seed, position) (SplitMix64 finaliser).

    Seeded sampling draws the token at sequence position ``i`` with ``keyed_uniform(seed,
    i)``, so the text depends on the seed and the model alone, not on how many draws
    came before: speculative decoding (whose draft lengths vary from run to run as its
    caches learn) then repeats the seeded text of plain decoding exactly.
    """
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


@dataclass
class Sampler:
    """Turns logits into a distribution and draws from it.

    ``distribution`` is the exact distribution ``sample`` draws from; speculative
    decoding uses it as the target's p (and the drafter's q), which is what makes the
    rejection rule lossless for every setting here.
    """

    params: SamplingParams = field(default_factory=SamplingParams)
    rng: np.random.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.params.seed)

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    def adjusted(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """The logits with the request's penalties (over the latest ``repeat_last_n`` of
        ``history``) and its logit bias applied: what every choice below starts from."""
        p = self.params
        recent = history[-p.repeat_last_n :] if p.repeat_last_n > 0 else history
        logits = apply_repetition_penalty(logits, recent, p.repetition_penalty)
        logits = apply_presence_frequency(logits, recent, p.presence_penalty, p.frequency_penalty)
        return apply_logit_bias(logits, p.logit_bias)

    def unbiased(self) -> Sampler:
        """This sampler without the logit bias, drawing from the same random stream: for a
        drafter whose token ids are another vocabulary's (the bias names the target's ids;
        verification applies it)."""
        if not self.params.logit_bias:
            return self
        other = Sampler(replace(self.params, logit_bias=()))
        other.rng = self.rng
        return other

    def distribution(self, logits: np.ndarray, history: Sequence[int] = ()) -> np.ndarray:
        p = self.params
        logits = self.adjusted(logits, history)
        if p.greedy:
            return greedy_distribution(logits)
        logits = top_k_mask(np.asarray(logits, dtype=np.float64) / p.temperature, p.top_k)
        probs = softmax(logits)
        probs = top_p_filter(probs, p.top_p)
        return min_p_filter(probs, p.min_p)

    def draw(self, probs: np.ndarray) -> int:
        """Inverse-CDF draw from a distribution, using this sampler's RNG."""
        cdf = np.cumsum(probs)
        r = self.rng.random() * cdf[-1]
        return int(min(np.searchsorted(cdf, r, side="right"), len(probs) - 1))

    def __call__(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        if self.params.greedy:
            return int(np.argmax(self.adjusted(logits, history)))
        return self.draw(self.distribution(logits, history))

    @property
    def keyed(self) -> bool:
        """Seeded sampling: each position's draw is fixed by (seed, position)."""
        return self.params.seed is not None and not self.params.greedy

    def sample_at(self, logits: np.ndarray, position: int, history: Sequence[int] = ()) -> int:
        """The token at sequence ``position`` (prompt included): with a seed, drawn with
        :func:`keyed_uniform` so every decoding strategy picks the same token there."""
        if not self.keyed:
            return self(logits, history)
        probs = self.distribution(logits, history)
        cdf = np.cumsum(probs)
        r = keyed_uniform(int(self.params.seed), position) * cdf[-1]  # type: ignore[arg-type]
        idx = int(min(np.searchsorted(cdf, r, side="right"), len(probs) - 1))
        while probs[idx] <= 0 and idx > 0:  # round-off at the top end: never a zero-probability token
            idx -= 1
        return idx
