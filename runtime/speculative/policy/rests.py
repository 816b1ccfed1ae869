"""Model-free sources that rest after their drafts keep being trimmed to nothing.

Asking a model-free source is not free on the host: the suffix tree and the prompt
lookup propose, and the adaptive policy prices every proposed length against the verify
costs (:meth:`~tandem.runtime.speculative.policy.adaptive.AdaptivePolicy.trim`). On
text they cannot predict, every ask ends trimmed to nothing, and on a GPU, whose
one-token step is 2 ms, that host work alone made model-free drafting slower than plain
decoding: on a 2-vCPU AVX2 EPYC host 275 µs a token against plain decoding's 87-109,
0.84-0.86x plain on a modeled 2 ms step (``benchmarks/host_overhead.py``). A source whose
last :attr:`RestSchedule.after` drafts were all trimmed to nothing is not asked for a few
rounds, twice as many each time it is asked again in vain (up to
:attr:`RestSchedule.longest`); one kept draft ends its rest. The policy rests sources only
where asking is dear against a step
(:data:`~tandem.runtime.speculative.policy.adaptive_config.ASKING_DEAR`). Resting changes only
which drafts are proposed, never how they are verified: output is the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RestSchedule:
    """Per source: drafts trimmed to nothing in a row, the rest earned, the rounds left."""

    after: int = 4
    """Drafts in a row trimmed to nothing before the first rest."""
    longest: int = 8
    """Rounds of the longest rest: text turning repetitive is seen at most this late."""
    _idle: dict[str, int] = field(default_factory=dict)
    _gap: dict[str, int] = field(default_factory=dict)
    _left: dict[str, int] = field(default_factory=dict)
    """Resting sources: rounds of their rest still to come after this one."""

    def resting(self, source: str) -> bool:
        return source in self._left

    def next_round(self) -> None:
        """A round began: a rest of g rounds skips the g rounds after the vain ask."""
        if self._left:
            self._left = {s: n - 1 for s, n in self._left.items() if n > 0}

    def judged(self, source: str, kept: int) -> None:
        """``source``'s draft was trimmed to ``kept`` tokens."""
        if kept:
            self.forget(source)
            return
        idle = self._idle[source] = self._idle.get(source, 0) + 1
        if idle >= self.after:
            gap = self._gap[source] = min(2 * self._gap.get(source, 1), self.longest)
            self._left[source] = gap
            self._idle[source] = self.after - 1  # once rested, one more vain ask rests it again

    def forget(self, source: str) -> None:
        self._idle.pop(source, None)
        self._gap.pop(source, None)
        self._left.pop(source, None)
