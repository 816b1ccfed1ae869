"""Per-round cost of the speculative loop itself, on a target that computes nothing.

A stub target answers every ``evaluate`` at once with logits whose argmax is the next
token of a fixed, repetitive text, so what is timed is the loop around the model calls:
model-free drafting (suffix tree and prompt lookup), the adaptive policy on a fixed
c(k), verification, the caches' bookkeeping and the round's stats. The reply is checked
to be the stub's greedy text. Compare two versions by running each in its own process,
alternating (``PYTHONPATH`` pointing at each tree):

    .venv/bin/python -m benchmarks.loop_overhead [REPS]
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.backends.protocol import MemoryReport, SpecialTokens
from tandem.runtime.generate import generate
from tandem.runtime.speculative.cost import CostCurve, OnlineCost
from tandem.runtime.speculative.drafters.chain import ChainDrafter
from tandem.runtime.speculative.drafters.lookup import PromptLookupDrafter
from tandem.runtime.speculative.drafters.suffix import SuffixDrafter
from tandem.runtime.speculative.loop import speculative
from tandem.runtime.speculative.policy.adaptive import AdaptivePolicy
from tandem.runtime.speculative.policy.adaptive_config import AdaptiveConfig

V = 512
"""The stub's vocabulary."""


def repetitive_text(seed: int = 0) -> list[int]:
    """A phrase repeated two times in three, with fresh tokens between: text that the
    model-free drafters draft well in places and not at all in others."""
    rng = np.random.default_rng(seed)
    phrase = [int(t) for t in rng.integers(3, V, 40)]
    text: list[int] = []
    for i in range(200):
        text += phrase if i % 3 else [int(t) for t in rng.integers(3, V, 25)]
    return text


TEXT = repetitive_text()


class StubTarget:
    """A target whose greedy continuation is :data:`TEXT`, computed for free."""

    n_vocab, n_ctx, exact_batch, name = V, 8192, 7, "stub"
    special = SpecialTokens(None, None)

    def __init__(self) -> None:
        self.tokens: list[int] = []

    def token_bytes(self, token: int) -> bytes:
        return b"x"

    def memory(self) -> MemoryReport:
        return MemoryReport(0, 0)

    def truncate(self, n: int) -> None:
        del self.tokens[n:]

    def evaluate(self, tokens, logits_for=None) -> np.ndarray:
        start = len(self.tokens)
        self.tokens += list(tokens)
        rows = list(range(len(tokens)) if logits_for is None else logits_for)
        out = np.zeros((len(rows), V), dtype=np.float32)
        for r, i in enumerate(rows):
            out[r, TEXT[start + i + 1]] = 1.0
        return out


def one_reply(n: int = 400) -> tuple[float, int, int]:
    """Microseconds per round of one ``n``-token reply, its rounds, its accepted drafts."""
    curve = CostCurve((1, 1.94, 2.29, 2.94, 3.13, 3.82, 4.67, 5.52, 6.37), 0.0)
    policy = AdaptivePolicy(OnlineCost(curve, chunk=7, measure_t1=False, learn=False), AdaptiveConfig(),
                            cheap_drafter=True)
    strategy = speculative(ChainDrafter([SuffixDrafter(), PromptLookupDrafter()]), policy)
    started = time.perf_counter()
    *_, done = generate(StubTarget(), TEXT[:60], Sampler(SamplingParams.greedy_params()), strategy=strategy,
                        max_tokens=n, stop_at_eog=False)
    seconds = time.perf_counter() - started
    assert done.tokens == TEXT[60:60 + n], "not the target's greedy text"
    return seconds / done.stats.target_calls * 1e6, done.stats.target_calls, done.stats.accepted_tokens


def main() -> None:
    res = [one_reply() for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 5)]
    print(f"us/round median {statistics.median(r[0] for r in res):.1f} min {min(r[0] for r in res):.1f} "
          f"rounds {res[0][1]} accepted {res[0][2]}")


if __name__ == "__main__":
    main()
