"""What the adaptive length policy is configured with: its settings (:class:`AdaptiveConfig`)
and the fixed thresholds its choices are measured against, each with the measurement
that set it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AdaptiveConfig:
    max_len: int = 8
    """Longest draft asked of a model drafter."""
    free_max_len: int = 32
    """Longest draft asked of a model-free drafter (suffix tree, prompt lookup): copying
    given text (edits, extraction) is right for long runs, and a greedy verification
    that rejects early stops after the first chunk, so asking far costs little."""
    stop_threshold: float | None = 0.8
    """SpecDec++ h: drafters stop once their estimated P(any rejection) exceeds it."""
    prior_accept: float = 0.8
    """Optimistic prior, so a new drafter gets tried before the data speaks."""
    prior_weight: float = 1.0
    decay: float = 0.98
    """Per-round forgetting of acceptance counts (effective memory ~50 rounds)."""
    min_gain: float = 1.02
    """Speculate only when the predicted speedup beats plain decoding by this margin."""
    probe_every: int = 8
    probe_max: int = 128
    probe_len: int = 2
    probe_promise: float = 1.10
    """An unproven model-free source is probed only where its draft, believed as
    :data:`UNPROVEN_POWER` says, would beat plain decoding by 10 % once trusted: a probe
    that fails costs c(2) - 1 steps for certain. At 2 threads (c(2) = 2.3-2.6) a 4-token
    match promised 1.05-1.07 and its probe failed on the first edit and extract prompts of
    every bench reply (one failed probe is 2-3 % of a 64-token reply), where trusted drafting
    on those workloads measured 0.97-1.00x anyway. 1.15 was tried and left: replayed on a
    fixed c(k) (``benchmarks/policy_replay.py``, 2 threads), it lifted the bench's own 12
    prompts (modeled 0.997 -> 1.015) and lowered 16 held-out ones (1.033 -> 1.013): which
    match is probed first decides whether a reply's source is trusted at all, and a
    threshold fitted to 12 replies only moves that lottery."""


PROBE_WORTHY = 0.85
"""A model-free draft predicted at this fraction of the break-even rate may be probed."""
PROBE_CEILING = 1.15
"""A model drafter that is off is probed only if, never wrong, it would beat plain
decoding by this much: a probe also pays the drafter's catch-up on every token since it
last ran (SmolLM2 drafting for the 1.5B on one core: 0.4 s, a seventh of a 64-token
reply, for a ceiling of 1.09 that no real acceptance reaches)."""
ASKING_DEAR = 0.02
"""Asking the model-free sources costs this much of a one-token call or more: worth
resting those that keep failing. On a CPU step of 15-100 ms asking is under 1 % and they
are asked every round (a rest would only delay the start of a copied run: an edit prompt
replayed on the 8-thread curve fell from 1.037x to 1.001x); on a GPU step of 2 ms it is
10-40 % (``benchmarks/host_overhead.py``)."""
FREE_CEILING = 1.10
"""A model-free draft is verified only if the target's verify cost lets a draft that is
never wrong beat plain decoding by this much: on one Zen 5 core the 1.5B verifies k + 1
tokens for k + 1 steps (c(6) = 6.0-6.6), so a perfect draft gains at most 6 %, which the
acceptance estimates are not sharp enough to win; ngram drafting there cost 7-18 % on
codegen (4 of 10 drafts accepted) before this bound."""
