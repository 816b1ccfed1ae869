"""What verifying costs: c(k), one call over k+1 tokens in units of a one-token call.

On a CPU, verifying k drafted tokens is not free (≈1.6x a step for k = 1 and ≈3.5x for
k = 8 for the Qwen 1.5B on 2 cores; ≈k+1 on one compute-bound core). The adaptive policy
(:mod:`.policy`) prices every draft length with it. A target with no curve cached for
this machine times a few call sizes in its first decoding rounds, which still emit tokens
(:attr:`OnlineCost.first_sizes`); the curve is then cached (:mod:`.cost_cache`) and learnt
online from every run's own verify calls (:class:`OnlineCost`).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from tandem.runtime.backends.protocol import Backend


def one_token_step_s(backend: Backend, reps: int = 3) -> float | None:
    """Seconds of one one-token call of ``backend``: the fastest of ``reps`` after a
    warm-up call, made past what its cache holds and taken back after (``None`` when
    its context has no room for them)."""
    keep = list(backend.tokens)
    if len(keep) + reps + 1 > backend.n_ctx:
        return None
    token = keep[-1] if keep else (backend.special.bos or 0)
    times: list[float] = []
    try:
        for _ in range(reps + 1):
            started = time.perf_counter()
            backend.evaluate([token])
            times.append(time.perf_counter() - started)
    finally:
        backend.truncate(len(keep))
    return min(times[1:])


@dataclass(frozen=True)
class CostCurve:
    """``c[k]`` = time(evaluate k+1 tokens) / time(evaluate 1 token); ``c[0] == 1``."""

    c: tuple[float, ...]
    t1_s: float
    """Seconds of a one-token call when measured."""

    def __call__(self, k: int) -> float:
        if k < len(self.c):
            return self.c[k]
        slope = (self.c[-1] - self.c[-2]) if len(self.c) > 1 else 1.0
        return self.c[-1] + slope * (k - len(self.c) + 1)

    @classmethod
    def linear(cls, per_token: float, k_max: int = 8, t1_s: float = 1.0) -> CostCurve:
        """A synthetic curve c(k) = 1 + per_token * k (tests, and GPU-like targets)."""
        return cls(tuple(1.0 + per_token * k for k in range(k_max + 1)), t1_s)


CPU_COST_CURVE = CostCurve((1.0, 1.7, 1.9, 2.1, 2.4, 2.55, 2.7, 2.85, 3.0), 0.0)
"""c(k) assumed where nothing was measured (as timed on a 2-core CPU on a toy model): the
planner's prediction before any model is open, and the adaptive policy's prior when
measuring is switched off (``SpecOptions.measure_cost=False``)."""


@dataclass
class OnlineCost:
    """c(k) learnt from the run's own verify calls, starting from a prior curve.

    Each verify call's seconds are kept per call size (an exponential moving average);
    the one-token time t1 comes from plain rounds when there are any, else from the
    observed sizes scaled by the prior. A size seen at least twice uses its own ratio,
    others the prior's scaled as far off as the seen ones were, and no call is priced
    above k + 1 steps. So the first token never waits for a measurement and a stale
    prior corrects itself within a few rounds.

    ``chunk``: the target's :attr:`~tandem.runtime.backends.protocol.Backend.exact_batch`. Calls
    longer than that are split (see ``speculative.verify_logits``), so a long draft
    costs the sum of its chunks — and, greedy, only the chunks reached before the first
    rejection (:meth:`expected_verify`).
    """

    prior: CostCurve
    chunk: int | None = None
    window: int = 16
    """Each size's time is the median of its last ``window`` calls: robust to the spikes
    of a shared machine, and — unlike a minimum — not biased by how often a size is
    seen (plain one-token calls are far more frequent than any one draft length, and a
    minimum over more samples is lower, which would make every draft look dear)."""

    sizes: int = 33
    """Call sizes learnt (tokens), enough for the longest model-free draft plus one."""
    t1_refresh: int = 64
    """Speculative calls after which a plain one-token call is wanted again: t1 must be
    measured, not inferred from the prior (inferred, every learnt c(k) would just
    reproduce the prior's ratio)."""
    measure_t1: bool = True
    """Ask for those plain rounds (off for a curve given as trusted, e.g. in tests)."""
    learn: bool = True
    """Learn from the calls observed; off, ``prior`` prices every call (a policy replayed
    on a fixed curve, ``benchmarks/policy_replay.py``: its choices then do not depend
    on how loaded the machine was)."""
    first_sizes: Sequence[int] = ()
    """Drafts per call (k) to time once, right after t1, before ``prior`` is trusted: a
    target with no curve cached for this machine (:meth:`untimed`). Timing before the
    first token (an earlier design) held it back 1-2.5 s on a new pair; timed in the
    first rounds instead, each call still emits at least its own token (padded drafts:
    :meth:`wants_size`). When the last is timed, ``prior`` becomes the curve through them
    (:func:`curve_from_times`)."""

    @classmethod
    def untimed(cls, k_max: int, chunk: int | None = None) -> OnlineCost:
        """For a target never timed on this machine: :data:`CPU_COST_CURVE` until its first
        rounds have timed :data:`FIRST_SIZES`, each capped at the longest exact call (a
        repacked target's chunk of 3 times 1 and 2 drafts)."""
        longest = min(k_max, chunk - 1) if chunk else k_max
        sizes = tuple(sorted({min(k, longest) for k in FIRST_SIZES if longest > 0}, reverse=True))
        placeholder = CostCurve(tuple(CPU_COST_CURVE(k) for k in range(k_max + 1)), 0.0)
        return cls(placeholder, chunk=chunk, first_sizes=sizes)

    def __post_init__(self) -> None:
        n = max(len(self.prior.c), self.chunk or 0, self.sizes)
        self._recent = [deque(maxlen=self.window) for _ in range(n)]
        self._v = np.zeros(n)
        self._w = np.zeros(n)
        self._since_t1 = 0
        self._scale = 1.0
        self._untimed = [k for k in self.first_sizes if 0 < k < n]
        self._prices: list[float] | None = None
        """:meth:`call` of every learnt size, made once after each observation: the policy
        prices every length of every source each round, and pricing them size by size
        (each scanning the others for the prior's scale) was most of a speculative
        round's host time, 0.2 ms of a 2 ms GPU step (``benchmarks/host_overhead.py``)."""
        self._prior_at: CostCurve | None = None
        self._prior_c: list[float] = []
        """``prior(k)`` for every learnt size, while the prior is ``_prior_at``."""
        self.version = 0
        """Counts the observations: what is priced from this cost can be kept until it moves."""

    def observe(self, k: int, seconds: float) -> None:
        """One verify call over ``k + 1`` tokens took ``seconds``."""
        if k >= len(self._v) or seconds <= 0 or not self.learn:
            return
        self._prices = None
        self.version += 1
        self._recent[k].append(seconds)
        self._w[k] += 1
        self._v[k] = statistics.median(self._recent[k])  # np.median: 0.3 ms a call, every token
        self._since_t1 = 0 if k == 0 else self._since_t1 + 1
        if k in self._untimed and self._w[0] >= 2:
            self._untimed.remove(k)
            if not self._untimed:
                times = {j: float(self._v[j]) for j in (0, *self.first_sizes) if 0 <= j < len(self._w) and self._w[j]}
                self.prior = curve_from_times(times, len(self.prior.c) - 1)

    def wants_t1(self) -> bool:
        """Whether the next round should be a plain one-token call, to measure t1."""
        return self.measure_t1 and (self._w[0] < 2 or self._since_t1 >= self.t1_refresh)

    def wants_size(self) -> int:
        """Drafts the next verify call should hold whatever was drafted (padded: the
        padding is verified like any draft, so the output is unchanged) to time a call
        size the prior still lacks; 0 when none is wanted."""
        return 0 if self.wants_t1() or not self._untimed else self._untimed[0]

    @property
    def timed(self) -> bool:
        """Whether the prior is a measured curve (not the placeholder of :meth:`untimed`)."""
        return not self._untimed

    @property
    def learnt(self) -> bool:
        """Whether calls were observed and the first sizes timed (worth saving)."""
        return bool(self._w.sum() >= 2) and self.timed

    @property
    def t1_s(self) -> float:
        if self._w[0] >= 2:
            return float(self._v[0])
        seen = [self._v[k] / self.prior(k) for k in range(len(self._v)) if self._w[k] >= 2]
        return statistics.median(seen) if seen else self.prior.t1_s

    def call(self, k: int) -> float:
        """Cost of one call over ``k + 1`` tokens, in one-token calls: learnt where this
        size was seen (at least twice), else the prior scaled by how far off it was on
        the sizes seen (the median ratio of their excess over one step); never above
        ``k + 1`` (a batch is never dearer than its tokens one by one)."""
        prices, scale = self._priced()
        if k < len(prices):
            return prices[k]
        return min(1.0 + (self.prior(k) - 1.0) * scale, k + 1.0)

    def calls_upto(self, n: int) -> list[float]:
        """:meth:`call` for ``k = 0..n``."""
        prices = self._priced()[0]
        return prices[:n + 1] if n < len(prices) else [self.call(k) for k in range(n + 1)]

    def _priced(self) -> tuple[list[float], float]:
        """Every learnt size's price and the prior's scale, made after an observation."""
        if self._prices is None:
            n = len(self._w)
            if self._prior_at is not self.prior:
                self._prior_at, self._prior_c = self.prior, [self.prior(k) for k in range(n)]
            prior = self._prior_c
            t1 = self.t1_s
            times = self._v.tolist()
            learnt = {k: max(1.0, times[k] / t1) for k, seen in enumerate(self._w.tolist())
                      if k > 0 and seen >= 2} if t1 > 0 else {}  # sizes called twice are priced as learnt
            scales = [(x - 1.0) / (prior[k] - 1.0) for k, x in learnt.items() if prior[k] > 1.0]
            self._scale = statistics.median(scales) if scales else 1.0
            self._prices = [1.0] + [min(learnt[k] if k in learnt else 1.0 + (prior[k] - 1.0) * self._scale, k + 1.0)
                                    for k in range(1, n)]
        return self._prices, self._scale

    def __call__(self, k: int) -> float:
        """Cost of verifying ``k`` drafts (``k + 1`` tokens), chunked as verification is."""
        step = self.chunk or k + 1
        full, rest = divmod(k + 1, step)
        return full * self.call(step - 1) + (self.call(rest - 1) if rest else 0.0)

    def expected_verify(self, k: int, a: np.ndarray) -> float:
        """Expected cost of verifying ``k`` drafts with acceptance ``a``, when greedy
        verification stops after the chunk holding the first rejection: chunk ``j`` is
        evaluated only if every draft before it was accepted."""
        return self.expected_verify_upto(a, k)[k]

    def expected_verify_upto(self, a: np.ndarray, n: int) -> list[float]:
        """:meth:`expected_verify` for every ``k = 0..n`` in one pass (the policy prices
        every length of every source each round): verifying ``k`` drafts in chunks of
        ``step`` tokens costs, over the chunk starts ``s = 0, step, ... <= k``,
        P(first ``s`` drafts accepted) · c(that chunk's size - 1); every chunk but the
        last is full, so a running sum over the earlier starts carries from ``k`` to ``k + 1``."""
        step = self.chunk or n + 1
        calls = self.calls_upto(min(n, step - 1))
        if step > n:  # one chunk: k drafts cost c(k), reached or not
            return calls
        reach = [1.0]  # P(first j drafts accepted)
        for x in np.asarray(a, dtype=np.float64)[:n].tolist():
            reach.append(reach[-1] * x)
        reach += [reach[-1]] * (n + 1 - len(reach))  # positions past ``a`` keep the last
        full = calls[-1]  # a full chunk's cost (used only once k reaches a second chunk)
        out = []
        before = 0.0  # sum of reach over the starts of the full chunks before k's last chunk
        for k in range(n + 1):
            last = k - k % step
            if last and k == last:
                before += reach[last - step]
            out.append(before * full + reach[last] * calls[k - last])
        return out

    @property
    def c(self) -> tuple[float, ...]:
        return tuple(self(k) for k in range(len(self.prior.c)))

    def curve(self) -> CostCurve:
        """What the run priced with, as a plain curve."""
        return CostCurve(tuple(np.maximum.accumulate([self.call(k) for k in range(len(self.prior.c))])), self.t1_s)

    def observed(self) -> dict[int, float]:
        """This run's own c(k) for each size it made at least one call of (k > 0):
        the median of its calls over the run's one-token time, never above k + 1.
        Nothing when fewer than :data:`T1_CALLS_TO_SAVE` one-token calls measured that
        time: every ratio rests on it, and two slow first calls (a burst of load as the
        run began) made one run report c(2), c(3) and c(6) all at 1.0."""
        t1 = self.t1_s
        if self._w[0] < T1_CALLS_TO_SAVE:
            return {}
        return {k: min(float(self._v[k]) / t1, k + 1.0) for k in range(1, len(self._w))
                if self._w[k] > 0 and t1 > 0}


SAVED_RUNS = 5
"""Runs whose own c(k) of each size a saved curve keeps (:func:`merge_runs`)."""
T1_CALLS_TO_SAVE = 4
"""One-token calls a run must have timed before its own c(k) are saved (:meth:`OnlineCost.observed`)."""


def merge_runs(saved: CostCurve | None, history: Mapping[int, Sequence[float]], run: CostCurve,
               observed: Mapping[int, float]) -> tuple[CostCurve, dict[int, list[float]]]:
    """The curve to save after a run, and the per-size history behind it: each size the
    run called takes the median of the last :data:`SAVED_RUNS` runs' own values (the
    saved value counting as the first when there is no history yet); the others keep
    what the run priced them at. One run's value of a size (a probe or two) is not
    trusted alone: a spike of one saved as it was made every next strategy believe c(2)
    was 2.86 where it is 2.3 on 2 cores, and a size that looks too dear is never called
    again to correct it; a prior slightly too cheap, on the other hand (the timed c(2)
    2.87 where calls take 3.0 on one core), moves as each run confirms it."""
    merged: dict[int, list[float]] = {k: list(v) for k, v in history.items() if 0 < k < len(run.c) and v}
    for k, value in observed.items():
        if not 0 < k < len(run.c):
            continue
        past = merged.get(k) or ([saved(k)] if saved is not None else [])
        merged[k] = [*past, value][-SAVED_RUNS:]
    if not merged:
        return run, merged
    # The sizes no run has called lie on the curve through those that have: what one run
    # priced them at (its prior stretched by that run's scale, up to k + 1) would, once
    # saved, have lifted every longer size with it (c(4) saved at 5.0 made c(5) and c(6)
    # 5.0 where their runs measured 3.6 and 4.4, and 3 drafts look as cheap as 2).
    points = {0: 1.0, **{k: robust_median(v) for k, v in merged.items()}}
    return replace(curve_from_times(points, len(run.c) - 1), t1_s=run.t1_s), merged


def robust_median(values: Sequence[float]) -> float:
    """The median of ``values`` less those more than twice or under half their median:
    one run whose one-token time was caught by a burst of load saved c(3) = 1.02 beside
    four runs of 2.5-3.2, and the plain median of five moved a rank towards it. The
    history keeps such values, so a lasting change wins once it is most of the runs."""
    mid = statistics.median(values)
    return statistics.median([x for x in values if mid / 2 <= x <= 2 * mid])


def _verify_clock(backend: Backend):
    """With one compute thread, CPU time is the steadiest measure on a busy machine (it
    excludes time other processes take); with several, idle-spinning threads would
    inflate it, so wall time it is. A target split over RPC servers computes mostly
    elsewhere and waits on the network: only wall time sees that."""
    compute = backend.compute_settings()
    return time.process_time if compute.threads == 1 and not compute.remote else time.perf_counter


def _time_verify(backend: Backend, rng: np.random.Generator, k: int, step: int, clock: Callable[[], float],
                 n_ctx: int) -> float:
    """Seconds of one verify call over ``k + 1`` random tokens after ``n_ctx`` cached ones,
    chunked at ``step`` as verification chunks it; the cache is rolled back to ``n_ctx``."""
    feed = [int(t) for t in rng.integers(3, backend.n_vocab, k + 1)]
    start = clock()
    for i in range(0, k + 1, step):
        backend.evaluate(feed[i:i + step], logits_for=range(len(feed[i:i + step])))
    elapsed = clock() - start
    backend.truncate(n_ctx)
    return elapsed


def measure_cost_curve(backend: Backend, k_max: int = 8, reps: int | None = None, context: int = 64) -> CostCurve:
    """Time one call over k+1 tokens (all rows' logits, as verification asks) against one
    token, interleaving k within each repetition. Leaves the cache as it was.

    Each c(k) is a ratio of *minimum* times over the repetitions: on a shared machine
    noise only ever adds time, and sub-millisecond calls are otherwise dominated by it.
    ``reps=None`` spends about two seconds (3 to 20 repetitions of 3-call blocks).
    """
    saved = backend.tokens
    rng = np.random.default_rng(0)
    n_ctx = min(context, max(1, backend.n_ctx - k_max - 2))
    prefix = [int(t) for t in rng.integers(3, backend.n_vocab, n_ctx)]
    backend.truncate(0)
    backend.evaluate(prefix)

    clock = _verify_clock(backend)

    step = backend.exact_batch or k_max + 1  # verification's own chunking (see verify_logits)

    def timed(k: int) -> float:
        return _time_verify(backend, rng, k, step, clock, n_ctx)

    warm = [timed(k) for k in range(k_max + 1)]  # warm-up pass, also sizes the budget
    if reps is None:
        reps = int(np.clip(2.0 / max(sum(warm), 1e-6), 3, 20))
    # Each k gets a short block of consecutive calls (min taken): decoding repeats one
    # batch shape round after round, and llama.cpp reuses the compute graph for a
    # repeated shape, which a strictly interleaved order would never let it do.
    times = np.array([[min(timed(k) for _ in range(3)) for k in range(k_max + 1)] for _ in range(reps)])
    backend.truncate(0)
    if saved:
        backend.evaluate(saved)
    best = times.min(axis=0)
    # A longer verify cannot be cheaper than a shorter one: enforce monotonicity.
    c = np.maximum.accumulate(best / best[0])
    return CostCurve(tuple(float(x) for x in c), float(best[0]))


FIRST_SIZES = (6, 3, 1)
"""Drafts per call timed in a new target's first rounds (after t1, :class:`OnlineCost`);
the rest of c(k) is interpolated. 6 is the longest exact llama.cpp call (see
``Backend.exact_batch``). Largest first: a reply with no room left for the largest
(`tandem run -n 8`) pads nothing (:func:`~tandem.runtime.speculative.timing.for_timing`),
where timing the small sizes first had each such reply pay them and then stop short of
the largest, so nothing was ever learnt and every short run paid again (4 padded
rounds, 10 drafted tokens, about 0.4 s of an 8-token `tandem run` of the 1.5B at 2
threads)."""


def curve_from_times(seconds: Mapping[int, float], k_max: int) -> CostCurve:
    """c(k) through one call's seconds per timed size (``seconds[0]``: one token),
    interpolated between them, extended with the last slope beyond, never below one
    step and never falling."""
    t1 = max(seconds[0], 1e-9)
    ks = sorted(seconds)
    c = np.interp(np.arange(k_max + 1), ks, [seconds[k] / t1 for k in ks])
    if k_max > ks[-1] and len(ks) > 1:  # beyond the longest timed size: its last slope
        slope = (seconds[ks[-1]] - seconds[ks[-2]]) / t1 / (ks[-1] - ks[-2])
        c[ks[-1] + 1:] = c[ks[-1]] + slope * (np.arange(ks[-1] + 1, k_max + 1) - ks[-1])
    c = np.maximum.accumulate(np.maximum(c, 1.0))
    c[0] = 1.0
    return CostCurve(tuple(float(x) for x in c), t1)
