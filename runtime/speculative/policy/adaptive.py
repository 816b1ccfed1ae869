"""The adaptive length policy: which source drafts each round, how much, or none at all
(see the package docstring for the model it maximises)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tandem.kernels.acceptance import expected_tokens, expected_tokens_upto
from tandem.runtime.speculative.cost import CostCurve, OnlineCost
from tandem.runtime.speculative.policy.adaptive_config import (
    ASKING_DEAR,
    FREE_CEILING,
    PROBE_CEILING,
    PROBE_WORTHY,
    AdaptiveConfig,
)
from tandem.runtime.speculative.policy.beliefs import (
    Acceptance,
    Calibration,
)
from tandem.runtime.speculative.policy.rests import RestSchedule


def best_index(rates: Sequence[float]) -> int:
    """The first length of the highest rate (``np.argmax`` of a short list costs more
    than the list: it is made into an array first)."""
    return max(range(len(rates)), key=rates.__getitem__)


@dataclass(frozen=True)
class _Outlook:
    free_ceiling: float
    """:meth:`AdaptivePolicy.free_ceiling`."""
    probe_pays: bool
    """:meth:`AdaptivePolicy.probe_can_pay`."""
    model_ceiling: float
    """:meth:`AdaptivePolicy.ceiling`."""


@dataclass
class AdaptivePolicy:
    """Expected-throughput maximiser over c(k), acceptance and drafter cost, per source.

    Every round, each draft source is worth E(k) / T(k) tokens per one-token call:
    E(k) = 1 + sum_j prod_{i<=j} a_i and T(k) = verify(k) + d·k + o, with plain
    decoding at exactly 1. Model-free sources (``cheap_sources``, or all of them with
    ``cheap_drafter``) are asked every round, since asking costs nothing; their draft is
    verified (its best prefix) when it beats both plain decoding and what the model
    drafter is predicted to give, else the model drafter drafts its best length, or the
    round is plain. Each source keeps its own acceptance statistics.
    """

    cost: CostCurve | OnlineCost
    config: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    draft_cost: float = 0.0
    """Model drafter seconds per drafted token / seconds of a one-token target call."""
    draft_cost_guessed: bool = False
    """:attr:`draft_cost` is a guess made before any round drafted (from the weights and
    one call of the drafter's model), not a measurement of drafting: the first timed
    round replaces it instead of being averaged in. The share of the target's weights
    leaves out what every call costs beyond reading them, and a cross-vocabulary drafter's
    translation and extra tokens: SmolLM2 next to the 1.5B was guessed at 0.09 of a step a
    drafted token and timed at 0.25-0.49 (2 threads, a Zen 5); averaging a fifth of each
    round in, its rounds of a whole bench run had only reached 0.15."""
    overhead: float = 0.0
    """Per-round bookkeeping of a speculative round, relative to a one-token call."""
    asking_cost: float = 0.0
    """Host time of asking the model-free sources a round, relative to a one-token call
    (learnt from rounds with no model draft): past :data:`ASKING_DEAR`, sources whose
    drafts keep being trimmed to nothing rest (:class:`RestSchedule`)."""
    cheap_drafter: bool = False
    """Only model-free drafters: every source is free to ask."""
    cheap_sources: frozenset[str] = frozenset()
    """In a chain of model-free drafters ahead of a model drafter: the model-free
    sources. The model drafter gets :attr:`model_budget` tokens per round."""
    catch_up_cost: float | None = None
    """Model drafter seconds per token it catches up on (one batched call) / seconds of a
    one-token target call; ``None`` until a catch-up is timed (:meth:`catch_up_per_token`)."""
    measured_sources: frozenset[str] = frozenset()
    """Model-free sources whose confidence is an acceptance rate measured for the use they
    are asked in, not a match heuristic: trusted from the start (not raised to
    :data:`UNPROVEN_POWER`, no short probe first), calibrated by their own verdicts with
    :data:`TRUST_AFTER` tokens of prior at face value (one rejection does not silence
    them), and never judged by the other sources' verdicts (they draft other text)."""

    def __post_init__(self) -> None:
        if isinstance(self.cost, CostCurve):  # a curve given as it is: trusted, not re-measured
            self.cost = OnlineCost(self.cost, measure_t1=False)
        self._model = self._acceptance(self.config.max_len)
        self._free: dict[str, Acceptance] = {}
        self.stop_threshold = self.config.stop_threshold
        self._off_rounds = 0
        self._probe_gap = self.config.probe_every
        self.rounds_off = 0
        self.probes = 0
        self.calibration = Calibration(self.is_free, self.measured_sources, self.config.decay)
        self.rests = RestSchedule()
        """Model-free sources not asked for a while: their drafts kept being trimmed to nothing."""
        self._outlook_cost: CostCurve | OnlineCost | None = None
        self._outlook_at: tuple[int, float, float] | None = None
        self._outlook_now = _Outlook(0.0, False, 0.0)
        self._last_conf: np.ndarray | None = None
        """The confidences of the model-free draft :meth:`trim` let through, for its verdict."""
        self.model_budget: int | None = None
        self.draft_timed = 0
        """Rounds that timed the model drafter (its :attr:`draft_cost` is then learnt)."""
        self._timing = 0
        self._asked_free = False
        """A model-free source was given a length this round (what :attr:`asking_cost` learns from)."""
        self._model_rate = 1.0
        """The rate the model drafter's length this round was chosen for (its estimate, or
        when probing, what it would reach if never wrong): what waking it is worth."""

    # -- model ------------------------------------------------------------------------
    @property
    def reached(self) -> np.ndarray:
        return self._model.reached

    @property
    def accepted(self) -> np.ndarray:
        return self._model.accepted

    @property
    def t1_s(self) -> float:
        return self.cost.t1_s

    def is_free(self, source: str) -> bool:
        return self.cheap_drafter or source in self.cheap_sources

    def acceptance(self) -> np.ndarray:
        """Conditional acceptance a_i of the model drafter's token i given the ones before."""
        return self._model.rates()

    def expected_tokens(self, k: int, a: np.ndarray | None = None) -> float:
        return expected_tokens(self.acceptance() if a is None else a, k)

    def expected_time(self, k: int) -> float:
        return 1.0 if k == 0 else self.cost(k) + self.draft_cost * k + self.overhead

    def rate(self, k: int, a: np.ndarray, draft_cost: float) -> float:
        """Expected tokens per one-token call of a round verifying ``k`` drafts."""
        return self.rates(a, draft_cost, k)[k]

    def rates(self, a: np.ndarray, draft_cost: float, n: int) -> list[float]:
        """:meth:`rate` for every length ``0..n``, in one pass: E(k) / T(k), plain = 1."""
        tokens = expected_tokens_upto(a, n)
        verify = self.cost.expected_verify_upto(a, n)
        return [1.0] + [tokens[k] / (verify[k] + draft_cost * k + self.overhead) for k in range(1, n + 1)]

    def predicted_speedup(self, k: int) -> float:
        return self.rate(k, self.acceptance(), self.draft_cost)

    def _best(self) -> tuple[int, float]:
        rates = self.rates(self.acceptance(), self.draft_cost, self.config.max_len)
        k = best_index(rates)
        return k, rates[k]

    def best_length(self) -> int:
        k, rate = self._best()
        return k if rate >= self.config.min_gain else 0

    def free_ceiling(self) -> float:
        """The best rate a model-free draft could reach if it were never wrong (it costs
        nothing to ask): how far the target's verify cost lets any draft pay."""
        return self._outlook().free_ceiling

    def _outlook(self) -> _Outlook:
        """What never-wrong drafts could reach on the costs as they stand: asked of every
        model-free draft and every round the model drafter is off, priced again only once
        the costs moved."""
        key = (self.cost.version, self.overhead, self.draft_cost)
        if self._outlook_cost is not self.cost or self._outlook_at != key:
            self._outlook_cost = self.cost
            cfg = self.config
            longest = min(cfg.free_max_len, 2 * (self.cost.chunk or cfg.max_len))
            n = max(longest, cfg.probe_len, cfg.max_len)
            verify = self.cost.expected_verify_upto(np.ones(n), n)
            free = self._never_wrong_rates(verify, max(longest, cfg.probe_len), 0.0)
            model = self._never_wrong_rates(verify, cfg.max_len, self.draft_cost)
            self._outlook_at = key
            self._outlook_now = _Outlook(max(free[1:longest + 1]), free[cfg.probe_len] >= cfg.min_gain, max(model[1:]))
        return self._outlook_now

    def ceiling(self) -> float:
        """The best rate the model drafter could reach if it were never wrong. Below
        :data:`PROBE_CEILING` it is not even probed (a compute-bound target, whose c(k)
        grows ~linearly, next to a drafter a third of its cost cannot pay at all): a probe
        would also pay the drafter's catch-up on every token since it last ran."""
        return self._outlook().model_ceiling

    def _never_wrong_rates(self, verify: list[float], longest: int, draft_cost: float) -> list[float]:
        """:meth:`rates` of lengths 0..``longest`` if every drafted token were accepted (a
        round of k drafts then yields k + 1 tokens), from ``verify``: the cost of verifying
        each length when every draft is accepted."""
        return [1.0] + [(k + 1.0) / (verify[k] + draft_cost * k + self.overhead) for k in range(1, longest + 1)]

    # -- per round --------------------------------------------------------------------
    def _off(self, n: int) -> int:
        """Speculation does not pay now: plain round, or a probe when one is due."""
        self.rounds_off += 1
        self._off_rounds += 1
        if self._off_rounds >= self._probe_gap:
            self._off_rounds = 0
            self._probe_gap = min(2 * self._probe_gap, self.config.probe_max)
            self.probes += 1
            return min(n, self.config.probe_len)
        return 0

    def _on(self, k: int) -> int:
        self._probe_gap = self.config.probe_every
        self._off_rounds = 0
        return k

    def next_length(self) -> int:
        self.rests.next_round()
        self._asked_free = False
        self._timing = self.cost.wants_size() if isinstance(self.cost, OnlineCost) else 0
        if isinstance(self.cost, OnlineCost) and self.cost.wants_t1():
            self.model_budget = 0
            return 0  # a plain round: it measures the one-token time every ratio is taken against
        if self._timing:  # a call size to time: model-free drafts, padded to it
            self.model_budget = 0
            return self._timing
        if self.cheap_drafter:
            return self.config.free_max_len  # asking is free; trim() decides what to verify
        k, self._model_rate = self._best()
        if k > 0 and self._model_rate >= self.config.min_gain:
            k = self._on(k)
        elif (ceiling := self.ceiling()) >= PROBE_CEILING:
            k, self._model_rate = self._off(self.config.max_len), ceiling
        else:
            k = 0
            self.rounds_off += 1  # could not pay enough at any acceptance: not even probed
        if self.cheap_sources:  # model-free drafters are always asked; the model gets k
            self.model_budget = k
            return max(self.config.free_max_len, k)
        return k

    def length_for(self, source: str, k: int) -> int:
        """Tokens to ask of ``source`` this round (``k``: :meth:`next_length`'s answer)."""
        if self.cheap_sources and not self.is_free(source):
            return min(k, self.model_budget or 0)
        if self._timing and not self.is_free(source):
            return 0  # a timing round never wakes the model drafter (its catch-up may never pay)
        if not self._timing and self.rests.resting(source):
            return 0
        self._asked_free = self._asked_free or (k > 0 and self.is_free(source))
        return k

    def timing_length(self) -> int:
        return self._timing

    def trim(self, confidence: Sequence[float] | None, n: int, source: str = "") -> int:
        """How many of ``n`` drafted tokens to verify.

        A model-free draft is judged by its own per-token confidence (suffix-tree
        frequencies), calibrated against observed acceptance, or else by its source's
        running per-position estimates; its best prefix is kept when it beats plain
        decoding and, next to a model drafter, what that drafter is predicted to give
        (otherwise 0, and the model drafter drafts instead).
        """
        self._last_conf = None
        if not self.is_free(source) or n == 0:
            return min(n, self.model_budget) if self.cheap_sources and self.model_budget is not None else n
        keep = self._trim_free(confidence, n, source)
        if source in self.measured_sources or self.asking_cost < ASKING_DEAR:
            self.rests.forget(source)  # the client's word or measured rates, or asking is cheap: always asked
        else:
            self.rests.judged(source, keep)
        return keep

    def _trim_free(self, confidence: Sequence[float] | None, n: int, source: str) -> int:
        """:meth:`trim` of a model-free draft."""
        if self.free_ceiling() < FREE_CEILING:
            return 0  # no draft can pay enough on this target here (a compute-bound verify)
        if confidence is not None:
            raw = np.asarray(confidence[:n], dtype=np.float64)
            a = self.calibration.believed(raw, source)
            self._last_conf = raw
        else:
            a = self._free_stats(source).rates()[:n]
            n = len(a)
        rates = self.rates(a, 0.0, n)
        m = best_index(rates)
        pays = m > 0 and rates[m] >= self.config.min_gain
        probe_pays = self.probe_can_pay()
        unproven = not self.calibration.proven(source)
        if pays and unproven:
            if not probe_pays or rates[m] < self.config.probe_promise:
                return 0  # trust could only be earned at a loss, or would gain too little
            m = min(m, self.config.probe_len)  # unproven: verify a short prefix first
        if self.cheap_sources:  # next to a model drafter: the better of the two drafts
            if self.model_budget and self._best()[1] > rates[m]:
                return 0
            return m if pays else 0
        if pays:
            return self._on(m)
        # A draft that nearly pays is worth an occasional probe when its source's verdicts
        # may have under-calibrated it; a hopeless one is not, nor one of an unproven
        # source (its first probe must promise ``probe_promise``): a failed probe costs c(m) - 1.
        near = probe_pays and m > 0 and rates[m] >= PROBE_WORTHY * self.config.min_gain
        return self._off(m) if near and not unproven else 0

    def probe_can_pay(self) -> bool:
        """Whether a probe (:attr:`AdaptiveConfig.probe_len` drafted tokens) beats plain
        decoding when it is right. On one Zen 5 core the 1.5B verifies 3 tokens for 3.0
        steps: probes there only ever cost, and a fresh strategy paid two failed ones per
        reply (6 % of 64 tokens) to learn that a source was not to be trusted."""
        return self._outlook().probe_pays

    def _acceptance(self, n: int) -> Acceptance:
        cfg = self.config
        return Acceptance(n, cfg.prior_accept, cfg.prior_weight, cfg.decay)

    def _free_stats(self, source: str) -> Acceptance:
        stats = self._free.get(source)
        if stats is None:
            stats = self._free[source] = self._acceptance(self.config.free_max_len)
        return stats

    def predraft_pays(self, n: int) -> bool:
        """Pre-draft when it cannot cost anything or probably hits. A pre-draft the target
        rejects is waited for before the next round drafts, which costs only the part of
        drafting that outlasts verification: ``(n + 1)·draft_cost − c(n)`` one-token calls.
        It is worth that when the chance of a hit — all ``n`` accepted and the bonus token
        guessed, ``Π a_i`` over ``n + 1`` positions — outweighs it against what a hit saves."""
        if n == 0:
            return False
        spill = (n + 1) * self.draft_cost - self.cost(n)
        if spill <= 0:
            return True
        a = self.acceptance()
        hit = float(np.prod(a[: min(n + 1, len(a))]))
        saved = min((n + 1) * self.draft_cost, self.cost(n))
        return hit * saved > (1 - hit) * spill

    def catch_up_per_token(self) -> float:
        """The model drafter's cost per caught-up token, in one-token target calls: as
        timed, or before that, its cost per drafted token scaled as the target's own verify
        call scales, ``c(k)/(k+1)`` at the longest draft (a batch spreads a call's cost
        over its tokens on the drafter as on the target: about 0.4 on 2 CPU cores, 0.15 on
        a GPU). The 0.5B drafter next to the 1.5B at 2 threads on a Zen 5: timed 0.15
        with the weights as stored (predicted 0.20), 0.19 repacked (predicted 0.29) — the
        0.5B prefills slower per token than the 1.5B there, so the target's own prompt
        rate would have predicted a third of it."""
        if self.catch_up_cost is not None:
            return self.catch_up_cost
        k = self.config.max_len
        return self.draft_cost * self.cost(k) / (k + 1)

    def catch_up_pays(self, source: str, backlog: int, remaining: int) -> bool:
        """Catching up costs ``backlog`` tokens at :meth:`catch_up_per_token`; drafting
        at the rate ``r`` this round was chosen for saves ``1 - 1/r`` of a step on each of
        the ``remaining`` tokens. Unpriced, the 0.5B drafter's first catch-up on a
        231-token edit prompt (2 threads, weights as stored, an Intel Xeon) cost about 2 s,
        25 steps of the 1.5B, which no 64-token reply earns back (one at 1.2x saves 11):
        auto ran 0.70-0.77x plain there."""
        if backlog <= 0 or self.is_free(source):
            return True
        saved = max(0, remaining) * (1.0 - 1.0 / max(self._model_rate, 1.0))
        return saved > backlog * self.catch_up_per_token()

    def renew(self, source: str) -> None:
        """A prediction's verdicts belong to its reply: carried over, a few wrong ones (the
        client's edit changed every line) made the next reply's right prediction look
        hopeless, and a draft never verified never earns trust back (a server slot after
        80 requests drafted nothing from a prediction it followed for 22 of 28 tokens)."""
        self.calibration.forget(source)
        self._free.pop(source, None)
        self.rests.forget(source)

    def observe_catch_up(self, source: str, tokens: int, seconds: float) -> None:
        t1 = self.cost.t1_s
        if self.is_free(source) or tokens <= 0 or t1 <= 0:
            return
        timed = seconds / tokens / t1
        self.catch_up_cost = timed if self.catch_up_cost is None else 0.5 * (self.catch_up_cost + timed)

    def observe(
        self, drafted: int, accepted: int, draft_s: float, verify_s: float, round_s: float, source: str = "",
        *, timed: bool = True, evaluated: int | None = None,
    ) -> None:
        """Learn from a round: acceptance for its source, and (``timed``) the verify cost
        of a call over ``evaluated`` tokens (default ``drafted + 1``) and the model
        drafter's cost per token."""
        evaluated = drafted + 1 if evaluated is None else evaluated
        if timed and self._asked_free and self.cost.t1_s > 0 and (drafted == 0 or self.is_free(source)):
            # only rounds that asked: a round every source rested through costs nothing,
            # and averaging it in would end the rests that made it cheap
            self.asking_cost = 0.8 * self.asking_cost + 0.2 * draft_s / self.cost.t1_s
        chunk = self.cost.chunk if isinstance(self.cost, OnlineCost) else None
        if timed and (chunk is None or evaluated <= chunk) and isinstance(self.cost, OnlineCost):
            self.cost.observe(evaluated - 1, verify_s)
        if drafted == 0:
            return
        if self.is_free(source):
            self._free_stats(source).observe(drafted, accepted)
            self._calibrate(drafted, accepted, source)
            return
        self._model.observe(drafted, accepted)
        self._calibrate(drafted, accepted, source)
        if not timed:
            return
        t1 = self.cost.t1_s
        if t1 > 0:
            timed_cost = draft_s / drafted / t1
            guessed = self.draft_cost_guessed and self.draft_timed == 0
            self.draft_cost = timed_cost if guessed else 0.8 * self.draft_cost + 0.2 * timed_cost
            self.draft_timed += 1
            extra = max(0.0, round_s - draft_s - verify_s) / t1
            self.overhead = 0.8 * self.overhead + 0.2 * extra

    def _calibrate(self, drafted: int, accepted: int, source: str) -> None:
        if self._last_conf is not None:
            self.calibration.record(self._last_conf, drafted, accepted, source)
            self._last_conf = None
