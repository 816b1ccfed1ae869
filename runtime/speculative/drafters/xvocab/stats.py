"""Telemetry of a :class:`~tandem.runtime.speculative.drafters.xvocab.drafter.CrossVocabDrafter`.

Kept apart so the drafter module stays about drafting; ``telemetry()`` turns it into
the flat dict that ``--json`` stats and the benchmarks report.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class XVocabStats:
    rounds: int = 0
    drafted: int = 0
    """Drafter-vocabulary tokens generated."""
    proposed: int = 0
    """Target-vocabulary tokens proposed after translation."""
    accepted: int = 0
    from_cache: int = 0
    """Proposed tokens that came from the n-gram cache."""
    learnt: int = 0
    """New cache entries this session."""
    unsynced: int = 0
    """Rounds skipped because the context text could not be re-encoded exactly."""
    anchored: int = 0
    """``text`` rounds whose re-tokenization a committed look-behind confirmed."""
    fallbacks: int = 0
    """``text`` rounds that fell back to token-level translation."""
    extra: dict[str, float] = field(default_factory=dict)

    def as_dict(self, cache_size: int) -> dict[str, float]:
        return {
            "rounds": self.rounds,
            "drafted": self.drafted,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
            "cache_hit_rate": self.from_cache / self.proposed if self.proposed else 0.0,
            "proposed_per_round": self.proposed / self.rounds if self.rounds else 0.0,
            "accepted_per_round": self.accepted / self.rounds if self.rounds else 0.0,
            "cache_size": cache_size,
            "learnt": self.learnt,
            "unsynced": self.unsynced,
            "anchored": self.anchored,
            "fallbacks": self.fallbacks,
        }
