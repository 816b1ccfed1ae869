"""What the adaptive policy believes of a draft source before and after the target's
verdicts: per-position acceptance counts, and how far a model-free draft's own confidence
(a suffix-tree frequency, a match length) is believed before the source has a record."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

TRUST_AFTER = 3.0
"""Confidence-weighted tokens a model-free source must have had verified before a draft
of it is verified at full length: a fresh strategy trusted its first confident draft at
face value and verified it whole (9 tokens, all rejected: 8 % of a 64-token reply on a
compute-bound target); now a :attr:`AdaptiveConfig.probe_len` prefix earns the trust."""
UNPROVEN_POWER = 3.0
"""Before any verdict on a model-free source, a draft of confidence c is believed at c³
(as if it had to come true three times): suffix-tree and lookup confidences are
optimistic on short matches, and workloads differ most there. Measured on the 1.5B's
greedy replies (96 tokens, 3 prompts per workload, the bench's prompts), first-token
acceptance of a draft of confidence 0.75 (a 2-token match) was 27 % on chat, 48 % on
codegen, 60-74 % on edit and extract; of 0.88, 40-45 % and 67-81 %; of 0.97 and above,
72-92 % everywhere. So at 2 threads (c(2) = 2.7), with
:attr:`AdaptiveConfig.probe_promise`, a first probe needs a long match of 5 tokens or
more where it needed two, a sure run (a re-asked prompt, 0.999) is believed at 0.997 (its
first token at :data:`UNPROVEN_FIRST`), and on a cheap verify (c(2) = 1.1) any draft is
still probed."""
UNPROVEN_FIRST = 0.8
"""Before any verdict, the first token of a model-free draft is believed at most this
likely, however sure its match: in the same measurement drafts of confidence 0.97 and
above had their first token accepted 72-92 % of the time (a reply's first sure match is
often the start of a code block the model then writes differently). Once the first token
holds, a sure run is believed as it stands, so a short sure match is no longer probed
where its verify barely pays (a 2-token match where 3 tokens cost 2.6 steps)."""


@dataclass
class Acceptance:
    """Decayed counts of how often drafted token i was reached and accepted, and the rate
    they give with a prior of ``prior_weight`` pseudo-rounds at ``prior``."""

    n: int
    prior: float
    prior_weight: float
    decay: float
    reached: np.ndarray = field(init=False)
    accepted: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.reached = np.zeros(self.n)
        self.accepted = np.zeros(self.n)

    def rates(self) -> np.ndarray:
        return (self.accepted + self.prior * self.prior_weight) / (self.reached + self.prior_weight)

    def observe(self, drafted: int, accepted: int) -> None:
        self.reached *= self.decay
        self.accepted *= self.decay
        tested = min(drafted, accepted + 1, len(self.reached))
        self.reached[:tested] += 1.0
        self.accepted[:min(accepted, len(self.accepted))] += 1.0


@dataclass
class Calibration:
    """How far each model-free source's own confidences (suffix-tree frequencies, match
    lengths: each source's own scale) are believed, from the target's verdicts on its
    drafts: per source, decayed (accepted tokens, summed confidence of the tokens tested).
    ``measured`` sources' confidences are acceptance rates already, trusted from the start
    (:data:`TRUST_AFTER` pseudo-tokens at face value); ``is_free`` names the model-free
    sources, which lend each other their verdicts until they have their own."""

    is_free: Callable[[str], bool]
    measured: frozenset[str]
    decay: float
    _verdicts: dict[str, tuple[float, float]] = field(default_factory=dict)

    def factor(self, source: str = "") -> float:
        """Observed acceptances per unit of predicted confidence for ``source`` (decayed).
        A model-free source with no verdict of its own yet starts from what the others
        earned: suffix tree and prompt lookup copy the same text, and where one's first
        probe failed (chat prose, a few matched words), the other's failed too — two
        failed probes a reply, 4 % of 64 tokens at 2 threads."""
        acc, conf = self.verdicts(source)
        prior = TRUST_AFTER if source in self.measured else 1.0  # pseudo-tokens at face value
        return min(max((acc + prior) / (conf + prior), 0.0), 1.5)

    def verdicts(self, source: str) -> tuple[float, float]:
        """(accepted, confidence tested) behind ``source``'s factor: its own, or the
        model-free sources' pooled while it has none."""
        acc, conf = self._verdicts.get(source, (0.0, 0.0))
        if conf == 0.0 and self.is_free(source) and source not in self.measured:
            pooled = [v for name, v in self._verdicts.items() if self.is_free(name) and name not in self.measured]
            acc, conf = sum(a for a, _ in pooled), sum(c for _, c in pooled)
        return acc, conf

    def proven(self, source: str) -> bool:
        """``source`` has earned full-length verification: measured, or :data:`TRUST_AFTER`
        confidence-weighted tokens of its own verified."""
        return source in self.measured or self._verdicts.get(source, (0.0, 0.0))[1] >= TRUST_AFTER

    def believed(self, confidence: np.ndarray, source: str) -> np.ndarray:
        """Acceptance rates a model-free draft's confidences stand for: calibrated by the
        verdicts so far, or, before any, raised to :data:`UNPROVEN_POWER` (the first at
        most :data:`UNPROVEN_FIRST`)."""
        if self.verdicts(source)[1] > 0.0:
            return np.clip(confidence * self.factor(source), 0.0, 0.999)
        rates = np.clip(confidence, 0.0, 0.999) ** (1.0 if source in self.measured else UNPROVEN_POWER)
        rates[:1] = np.minimum(rates[:1], UNPROVEN_FIRST)
        return rates

    def forget(self, source: str) -> None:
        """``source``'s verdicts no longer count (it drafts other text now)."""
        self._verdicts.pop(source, None)

    def record(self, confidence: np.ndarray, drafted: int, accepted: int, source: str) -> None:
        """The verdict on a draft of these confidences: the tokens tested (the accepted
        ones and the first rejected) count."""
        tested = min(drafted, accepted + 1)
        acc, conf = self._verdicts.get(source, (0.0, 0.0))
        self._verdicts[source] = (self.decay * acc + accepted, self.decay * conf + float(np.sum(confidence[:tested])))
