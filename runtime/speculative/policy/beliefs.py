"""What the adaptive policy believes of a draft source before and after the target's
verdicts: per-position acceptance counts, and how far a model-free draft's own confidence
(a suffix-tree frequency, a match length) is believed before the source has a record."""

from __future__ import annotations

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
