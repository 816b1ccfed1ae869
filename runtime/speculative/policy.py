"""Adaptive speculation: which source drafts each round, how much, or none at all.

On a CPU, verifying k drafted tokens is not free: one call over k+1 tokens costs c(k)
times a one-token call (≈1.6x for k=1, ≈3.5x for k=8 for the Qwen 1.5B on 2 cores). So
the engine

1. learns c(k) online from the run's own verify calls (:class:`OnlineCost`), starting
   from a curve measured for this model on this machine (cached in the user cache dir
   by ``tandem bench``) or a generic CPU prior — nothing is measured before the first
   token;
2. keeps, per draft source, a decayed estimate of the conditional acceptance a_i of the
   i-th drafted token (given the ones before it were accepted), plus the model
   drafter's cost per token and the per-round overhead, relative to a one-token call;
3. picks, each round, the source and length maximising expected tokens per unit time,
   E(k) / T(k) with E(k) = 1 + sum_j prod_{i<=j} a_i and T(k) = c(k) + d k + o,
   where k = 0 is plain decoding (E = T = 1); model-free sources (d = 0) are asked
   every round and judged by their draft's own confidence;
4. when k = 0 wins, speculation is off; it probes again after a back-off that doubles
   while probes keep failing, so the worst case stays within a few percent of plain;
5. passes a SpecDec++ threshold to drafters that can stop early: stop drafting when
   the drafter's own estimate of P(any rejection) exceeds it.

The length only changes which tokens get verified, never the acceptance rule, so any
policy keeps decoding lossless.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from tandem.kernels.acceptance import expected_tokens
from tandem.runtime.backends.protocol import Backend


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
"""c(k) assumed where nothing was measured (a 2-core CPU on a toy model, issue 3): the
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

    def __post_init__(self) -> None:
        n = max(len(self.prior.c), self.chunk or 0, self.sizes)
        self._recent = [deque(maxlen=self.window) for _ in range(n)]
        self._v = np.zeros(n)
        self._w = np.zeros(n)
        self._since_t1 = 0
        self._scale: float | None = None

    def observe(self, k: int, seconds: float) -> None:
        """One verify call over ``k + 1`` tokens took ``seconds``."""
        if k >= len(self._v) or seconds <= 0:
            return
        self._scale = None
        self._recent[k].append(seconds)
        self._w[k] += 1
        self._v[k] = float(np.median(self._recent[k]))
        self._since_t1 = 0 if k == 0 else self._since_t1 + 1

    def wants_t1(self) -> bool:
        """Whether the next round should be a plain one-token call, to measure t1."""
        return self.measure_t1 and (self._w[0] < 2 or self._since_t1 >= self.t1_refresh)

    @property
    def learnt(self) -> bool:
        """Whether any call was observed (worth saving)."""
        return bool(self._w.sum() >= 2)

    @property
    def t1_s(self) -> float:
        if self._w[0] >= 2:
            return float(self._v[0])
        seen = [self._v[k] / self.prior(k) for k in range(len(self._v)) if self._w[k] >= 2]
        return float(np.median(seen)) if seen else self.prior.t1_s

    def _learnt(self, k: int) -> float | None:
        t1 = self.t1_s
        if 0 < k < len(self._w) and self._w[k] >= 2 and t1 > 0:
            return max(1.0, float(self._v[k] / t1))
        return None

    def call(self, k: int) -> float:
        """Cost of one call over ``k + 1`` tokens, in one-token calls: learnt where this
        size was seen, else the prior scaled by how far off it was on the sizes seen."""
        if k == 0:
            return 1.0
        learnt = self._learnt(k)
        if learnt is not None:
            return min(learnt, k + 1.0)  # a batch is never dearer than its tokens one by one
        return min(1.0 + (self.prior(k) - 1.0) * self._prior_scale(), k + 1.0)

    def _prior_scale(self) -> float:
        """How far off the prior was on the sizes seen (median ratio of their excess
        over one step), recomputed only after a new observation: the policy prices every
        length each round, and this scan over all sizes was a millisecond a round."""
        if self._scale is None:
            scales = [(x - 1.0) / (self.prior(j) - 1.0) for j in range(1, len(self._w))
                      if (x := self._learnt(j)) is not None and self.prior(j) > 1.0]
            self._scale = float(np.median(scales)) if scales else 1.0
        return self._scale

    def __call__(self, k: int) -> float:
        """Cost of verifying ``k`` drafts (``k + 1`` tokens), chunked as verification is."""
        step = self.chunk or k + 1
        full, rest = divmod(k + 1, step)
        return full * self.call(step - 1) + (self.call(rest - 1) if rest else 0.0)

    def expected_verify(self, k: int, a: np.ndarray) -> float:
        """Expected cost of verifying ``k`` drafts with acceptance ``a``, when greedy
        verification stops after the chunk holding the first rejection: chunk ``j`` is
        evaluated only if every draft before it was accepted."""
        step = self.chunk or k + 1
        total, reach, start = 0.0, 1.0, 0
        while start < k + 1:
            size = min(step, k + 1 - start)
            total += reach * self.call(size - 1)
            end = start + size  # drafts 0..end-1 must be accepted to go on
            reach *= float(np.prod(a[start:min(end, k)])) if end <= k else 1.0
            start = end
        return total

    @property
    def c(self) -> tuple[float, ...]:
        return tuple(self(k) for k in range(len(self.prior.c)))

    def curve(self) -> CostCurve:
        """What was learnt, as a plain curve (to cache for the next run)."""
        return CostCurve(tuple(np.maximum.accumulate([self.call(k) for k in range(len(self.prior.c))])), self.t1_s)


def _verify_clock(backend: Backend):
    """With one compute thread, CPU time is the steadiest measure on a busy machine (it
    excludes time other processes take); with several, idle-spinning threads would
    inflate it, so wall time it is. A target split over RPC servers computes mostly
    elsewhere and waits on the network: only wall time sees that."""
    config = getattr(backend, "config", None)
    remote = bool(getattr(config, "rpc", ()))
    return time.process_time if getattr(config, "n_threads", None) == 1 and not remote else time.perf_counter


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
        feed = [int(t) for t in rng.integers(3, backend.n_vocab, k + 1)]
        start = clock()
        for i in range(0, k + 1, step):
            backend.evaluate(feed[i:i + step], logits_for=range(len(feed[i:i + step])))
        elapsed = clock() - start
        backend.truncate(n_ctx)
        return elapsed

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


QUICK_SIZES = (0, 1, 3, 6)
"""Call sizes (k drafts, k + 1 tokens) :func:`quick_cost_curve` times; the rest of c(k)
is interpolated. 6 is the longest exact llama.cpp call (see ``Backend.exact_batch``)."""


def quick_cost_curve(backend: Backend, k_max: int = 8, sizes: Sequence[int] = QUICK_SIZES,
                     context: int = 32) -> CostCurve:
    """A first c(k) for this model and machine, in about 20 one-token times (0.9 s for a
    1.5B on one core): one warm-up call, then one call of each of ``sizes`` after a short
    random context, c(k) interpolated between them and extended with the last slope.
    Taken once, when the first strategy with drafting is built and no curve is cached,
    so the adaptive policy never starts from a guess: on a compute-bound CPU a flat
    guess made it draft for dozens of rounds that could not pay (0.71x plain on the 1.5B
    with the 0.5B drafter); the run's own verify calls refine it (:class:`OnlineCost`).
    Leaves the cache as it was."""
    saved = backend.tokens
    rng = np.random.default_rng(0)
    n_ctx = min(context, max(1, backend.n_ctx - max(sizes) - 2))
    backend.truncate(0)
    backend.evaluate([int(t) for t in rng.integers(3, backend.n_vocab, n_ctx)])
    step = backend.exact_batch or max(sizes) + 1
    clock = _verify_clock(backend)

    def timed(k: int) -> float:
        feed = [int(t) for t in rng.integers(3, backend.n_vocab, k + 1)]
        start = clock()
        for i in range(0, k + 1, step):
            backend.evaluate(feed[i:i + step], logits_for=range(len(feed[i:i + step])))
        elapsed = clock() - start
        backend.truncate(n_ctx)
        return elapsed

    timed(max(sizes))  # warm-up: first calls of a shape build its graph
    seconds = {k: timed(k) for k in sorted(set(sizes))}
    backend.truncate(0)
    if saved:
        backend.evaluate(saved)
    t1 = max(seconds[0], 1e-9)
    ks = sorted(seconds)
    c = np.interp(np.arange(k_max + 1), ks, [seconds[k] / t1 for k in ks])
    if k_max > ks[-1] and len(ks) > 1:  # beyond the longest timed size: its last slope
        slope = (seconds[ks[-1]] - seconds[ks[-2]]) / t1 / (ks[-1] - ks[-2])
        c[ks[-1] + 1:] = c[ks[-1]] + slope * (np.arange(ks[-1] + 1, k_max + 1) - ks[-1])
    c = np.maximum.accumulate(np.maximum(c, 1.0))
    c[0] = 1.0
    return CostCurve(tuple(float(x) for x in c), t1)


def machine_id() -> str:
    """Identifies the machine for the c(k) cache: host, CPU model, cores, platform."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{platform.node()}|{cpu}|{cores}|{platform.machine()}|{platform.system()}"


def cost_curve_key(backend: Backend) -> str | None:
    """Cache key: the model file (path, size, mtime) + backend settings + machine."""
    path = getattr(backend, "path", None)
    if path is None or not Path(path).exists():
        return None
    st = Path(path).stat()
    config = getattr(backend, "config", None)
    if config is not None and hasattr(config, "n_ctx"):  # context size does not change c(k) much
        from dataclasses import replace

        config = replace(config, n_ctx=None)
    raw = f"{Path(path).resolve()}|{st.st_size}|{st.st_mtime_ns}|{config!r}|{machine_id()}|v3"
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def _cost_table(file: Path) -> dict:
    try:
        return json.loads(file.read_text()) if file.exists() else {}
    except (OSError, ValueError):
        return {}


def _cost_file(cache_file: Path | None) -> Path:
    from tandem.models.paths import cache_dir

    return cache_file or cache_dir() / "verify_cost.json"


def cached_cost_curve(backend: Backend, k_max: int = 8, *, cache_file: Path | None = None) -> CostCurve | None:
    """The c(k) cached for this model, settings and machine (measured or learnt), if any
    (none when the cache folder cannot be made: decoding then starts from the prior)."""
    key = cost_curve_key(backend)
    try:
        entry = _cost_table(_cost_file(cache_file)).get(key) if key is not None else None
    except OSError:
        return None
    if entry and len(entry.get("c", ())) > k_max:
        return CostCurve(tuple(entry["c"]), float(entry["t1_s"]))
    return None


def remember_cost_curve(backend: Backend, curve: CostCurve, *, cache_file: Path | None = None) -> None:
    """Cache ``curve`` for this model, settings and machine (atomic write; best effort:
    a read-only cache dir only means the next run starts from the prior again)."""
    key = cost_curve_key(backend)
    if key is not None:
        _store(key, {"c": list(curve.c), "t1_s": curve.t1_s, "model": str(getattr(backend, "path", ""))},
               cache_file)


def _store(key: str, entry: dict, cache_file: Path | None) -> None:
    """Write one entry of the cost cache (atomic; best effort: a read-only cache dir only
    means the next run starts from the prior again)."""
    try:
        file = _cost_file(cache_file)
        table = _cost_table(file)
        table[key] = entry | {"machine": machine_id(), "measured_at": time.time()}
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1))
        tmp.replace(file)
    except OSError:
        pass


def _draft_cost_key(target: Backend, drafter_name: str, drafter_bytes: int) -> str | None:
    key = cost_curve_key(target)
    if key is None:
        return None
    return "draft:" + hashlib.sha256(f"{key}|{drafter_name}|{drafter_bytes}".encode()).hexdigest()[:24]


def cached_draft_cost(target: Backend, drafter_name: str, drafter_bytes: int, *,
                      cache_file: Path | None = None) -> float | None:
    """A model drafter's cost per drafted token (in one-token target calls) as an earlier
    run with this target, drafter and machine learnt it, if any. A fresh strategy starts
    from it instead of the drafter's weight share: a drafter that cannot pay here (a
    cross-vocabulary one whose text translation costs more than its weights suggest) is
    then never probed, where each new conversation used to pay a probe and its catch-up
    to learn that again."""
    key = _draft_cost_key(target, drafter_name, drafter_bytes)
    try:
        entry = _cost_table(_cost_file(cache_file)).get(key) if key is not None else None
    except OSError:
        return None
    return float(entry["draft_cost"]) if entry and entry.get("draft_cost", 0) > 0 else None


def remember_draft_cost(target: Backend, drafter_name: str, drafter_bytes: int, draft_cost: float, *,
                        cache_file: Path | None = None) -> None:
    """Cache what a run learnt of a model drafter's cost (best effort, atomic)."""
    key = _draft_cost_key(target, drafter_name, drafter_bytes)
    if key is not None and draft_cost > 0:
        _store(key, {"draft_cost": draft_cost, "drafter": drafter_name}, cache_file)


def load_cost_curve(backend: Backend, k_max: int = 8, *, cache_file: Path | None = None) -> CostCurve:
    """The cached c(k) for this model and machine, measuring it (about two seconds) on
    first use. Benchmarks use it; decoding starts from :func:`cached_cost_curve` or a
    prior and learns online instead (:class:`OnlineCost`)."""
    curve = cached_cost_curve(backend, k_max, cache_file=cache_file)
    if curve is None:
        curve = measure_cost_curve(backend, k_max)
        remember_cost_curve(backend, curve, cache_file=cache_file)
    return curve


class LengthPolicy(Protocol):
    """Chooses the draft length each round and learns from the outcome."""

    stop_threshold: float | None

    def next_length(self) -> int: ...

    def length_for(self, source: str, k: int) -> int:
        """Tokens to ask of the drafter named ``source`` in a round of length ``k``."""
        ...

    def trim(self, confidence: Sequence[float] | None, n: int, source: str = "") -> int:
        """How many of the ``n`` drafted tokens to verify (may be all, or none)."""
        ...

    def predraft_pays(self, n: int) -> bool:
        """Whether drafting the next round during the verification of ``n`` drafts is
        worth it (PEARL's pre-drafting, "where the acceptance outlook allows")."""
        ...

    def observe(
        self, drafted: int, accepted: int, draft_s: float, verify_s: float, round_s: float, source: str = "",
        *, timed: bool = True, evaluated: int | None = None,
    ) -> None:
        """Learn from a round (``evaluated``: tokens the verify call(s) evaluated). ``timed=False``: the times are not representative (the
        first round of a generation also pays the drafter's catch-up on the whole prompt
        and, on a GPU, first-launch costs) and only the acceptance counts."""
        ...


@dataclass
class FixedLength:
    """Always ask for ``k`` tokens (the drafter may return fewer)."""

    k: int
    stop_threshold: float | None = None

    def next_length(self) -> int:
        return self.k

    def length_for(self, source: str, k: int) -> int:
        return k

    def trim(self, confidence: Sequence[float] | None, n: int, source: str = "") -> int:
        return n

    def predraft_pays(self, n: int) -> bool:
        return True

    def observe(
        self, drafted: int, accepted: int, draft_s: float, verify_s: float, round_s: float, source: str = "",
        *, timed: bool = True, evaluated: int | None = None,
    ) -> None:
        return None


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


PROBE_WORTHY = 0.85
PROBE_CEILING = 1.15
"""A model drafter that is off is probed only if, never wrong, it would beat plain
decoding by this much: a probe also pays the drafter's catch-up on every token since it
last ran (SmolLM2 drafting for the 1.5B on one core: 0.4 s, a seventh of a 64-token
reply, for a ceiling of 1.09 that no real acceptance reaches)."""
TRUST_AFTER = 3.0
"""Confidence-weighted tokens a model-free source must have had verified before a draft
of it is verified at full length: a fresh strategy trusted its first confident draft at
face value and verified it whole (9 tokens, all rejected: 8 % of a 64-token reply on a
compute-bound target); now a :attr:`AdaptiveConfig.probe_len` prefix earns the trust."""
"""A model-free draft predicted at this fraction of the break-even rate may be probed."""


class _Acceptance:
    """Decayed counts of how often drafted token i was reached and accepted."""

    def __init__(self, n: int, config: AdaptiveConfig) -> None:
        self.reached = np.zeros(n)
        self.accepted = np.zeros(n)
        self.config = config

    def rates(self) -> np.ndarray:
        cfg = self.config
        return (self.accepted + cfg.prior_accept * cfg.prior_weight) / (self.reached + cfg.prior_weight)

    def observe(self, drafted: int, accepted: int) -> None:
        self.reached *= self.config.decay
        self.accepted *= self.config.decay
        tested = min(drafted, accepted + 1, len(self.reached))
        self.reached[:tested] += 1.0
        self.accepted[:min(accepted, len(self.accepted))] += 1.0


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
    overhead: float = 0.0
    """Per-round bookkeeping of a speculative round, relative to a one-token call."""
    cheap_drafter: bool = False
    """Only model-free drafters: every source is free to ask."""
    cheap_sources: frozenset[str] = frozenset()
    """In a chain of model-free drafters ahead of a model drafter: the model-free
    sources. The model drafter gets :attr:`model_budget` tokens per round."""

    def __post_init__(self) -> None:
        if isinstance(self.cost, CostCurve):  # a curve given as it is: trusted, not re-measured
            self.cost = OnlineCost(self.cost, measure_t1=False)
        self._model = _Acceptance(self.config.max_len, self.config)
        self._free: dict[str, _Acceptance] = {}
        self.stop_threshold = self.config.stop_threshold
        self._off_rounds = 0
        self._probe_gap = self.config.probe_every
        self.rounds_off = 0
        self.probes = 0
        self._calib: dict[str, tuple[float, float]] = {}
        """Per source: decayed (accepted tokens, summed confidence of the tokens tested)."""
        self._last_conf: np.ndarray | None = None
        self.model_budget: int | None = None
        self.draft_timed = 0
        """Rounds that timed the model drafter (its :attr:`draft_cost` is then learnt)."""

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
        if k == 0:
            return 1.0
        verify = self.cost.expected_verify(k, a)
        return self.expected_tokens(k, a) / (verify + draft_cost * k + self.overhead)

    def predicted_speedup(self, k: int) -> float:
        return self.rate(k, self.acceptance(), self.draft_cost)

    def _best(self) -> tuple[int, float]:
        a = self.acceptance()
        rates = [self.rate(k, a, self.draft_cost) for k in range(self.config.max_len + 1)]
        k = int(np.argmax(rates))
        return k, rates[k]

    def best_length(self) -> int:
        k, rate = self._best()
        return k if rate >= self.config.min_gain else 0

    def ceiling(self) -> float:
        """The best rate the model drafter could reach if it were never wrong. Below
        :data:`PROBE_CEILING` it is not even probed (a compute-bound target, whose c(k)
        grows ~linearly, next to a drafter a third of its cost cannot pay at all): a probe
        would also pay the drafter's catch-up on every token since it last ran."""
        ones = np.ones(self.config.max_len)
        return max(self.rate(k, ones, self.draft_cost) for k in range(1, self.config.max_len + 1))

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
        if isinstance(self.cost, OnlineCost) and self.cost.wants_t1():
            self.model_budget = 0
            return 0  # a plain round: it measures the one-token time every ratio is taken against
        if self.cheap_drafter:
            return self.config.free_max_len  # asking is free; trim() decides what to verify
        k = self.best_length()
        if k > 0:
            k = self._on(k)
        elif self.ceiling() >= PROBE_CEILING:
            k = self._off(self.config.max_len)
        else:
            self.rounds_off += 1  # could not pay enough at any acceptance: not even probed
        if self.cheap_sources:  # model-free drafters are always asked; the model gets k
            self.model_budget = k
            return max(self.config.free_max_len, k)
        return k

    def length_for(self, source: str, k: int) -> int:
        """Tokens to ask of ``source`` this round (``k``: :meth:`next_length`'s answer)."""
        if self.cheap_sources and not self.is_free(source):
            return min(k, self.model_budget or 0)
        return k

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
        if confidence is not None:
            raw = np.asarray(confidence[:n], dtype=np.float64)
            a = np.clip(raw * self.calibration(source), 0.0, 0.999)
            self._last_conf = raw
        else:
            a = self._free_stats(source).rates()[:n]
            n = len(a)
        rates = [self.rate(m, a, 0.0) for m in range(n + 1)]
        m = int(np.argmax(rates))
        pays = m > 0 and rates[m] >= self.config.min_gain
        if pays and self._calib.get(source, (0.0, 0.0))[1] < TRUST_AFTER:
            m = min(m, self.config.probe_len)  # unproven: verify a short prefix first
        if self.cheap_sources:  # next to a model drafter: the better of the two drafts
            if self.model_budget and self._best()[1] > rates[m]:
                return 0
            return m if pays else 0
        if pays:
            return self._on(m)
        # A draft that nearly pays is worth an occasional probe (its confidence may be
        # under-calibrated); a hopeless one is not: a failed probe costs c(m) - 1 steps.
        return self._off(m) if m > 0 and rates[m] >= PROBE_WORTHY * self.config.min_gain else 0

    def _free_stats(self, source: str) -> _Acceptance:
        stats = self._free.get(source)
        if stats is None:
            stats = self._free[source] = _Acceptance(self.config.free_max_len, self.config)
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

    def calibration(self, source: str = "") -> float:
        """Observed acceptances per unit of predicted confidence for ``source`` (decayed):
        each source's confidence (suffix-tree frequencies, match lengths) is its own scale."""
        acc, conf = self._calib.get(source, (0.0, 0.0))
        return float(np.clip((acc + 1.0) / (conf + 1.0), 0.0, 1.5))

    def observe(
        self, drafted: int, accepted: int, draft_s: float, verify_s: float, round_s: float, source: str = "",
        *, timed: bool = True, evaluated: int | None = None,
    ) -> None:
        """Learn from a round: acceptance for its source, and (``timed``) the verify cost
        of a call over ``evaluated`` tokens (default ``drafted + 1``) and the model
        drafter's cost per token."""
        evaluated = drafted + 1 if evaluated is None else evaluated
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
            self.draft_cost = 0.8 * self.draft_cost + 0.2 * (draft_s / drafted / t1)
            self.draft_timed += 1
            extra = max(0.0, round_s - draft_s - verify_s) / t1
            self.overhead = 0.8 * self.overhead + 0.2 * extra

    def _calibrate(self, drafted: int, accepted: int, source: str) -> None:
        if self._last_conf is not None:
            tested = min(drafted, accepted + 1)
            acc, conf = self._calib.get(source, (0.0, 0.0))
            decay = self.config.decay
            self._calib[source] = (decay * acc + accepted, decay * conf + float(np.sum(self._last_conf[:tested])))
            self._last_conf = None
