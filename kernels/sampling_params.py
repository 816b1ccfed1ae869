"""What a request asks the sampler for: :class:`SamplingParams`, kept apart from the
sampling functions (:mod:`tandem.kernels.sampling`) so the command line and the chat app
can hold them before numpy is loaded."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repetition_penalty: float = 1.0
    repeat_last_n: int = 64
    """How many of the latest tokens (prompt included) every penalty looks at; 0: all."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, value) added to that token's logit at every position (see :func:`apply_logit_bias`)."""
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalized(self) -> bool:
        """A penalty is on: each position's distribution depends on the tokens before it."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @classmethod
    def greedy_params(cls) -> SamplingParams:
        return cls(temperature=0.0)
