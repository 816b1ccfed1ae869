"""Adaptive speculation: how many tokens to draft each round, or none at all.

On a CPU, verifying k drafted tokens is not free: one call over k+1 tokens costs c(k)
times a one-token call (≈1.7x for k=1, ≈3x for k=8 on this class of machine). So the
engine

1. measures the verify-cost curve c(k) once per model file and machine and caches it
   in the user cache dir (:func:`load_cost_curve`);
2. keeps a running, decayed estimate of the conditional acceptance a_i of the i-th
   drafted token (given the ones before it were accepted), plus the drafter's cost per
   token and the per-round overhead, both relative to a one-token target call;
3. picks the draft length maximising expected tokens per unit time,
   E(k) / T(k) with E(k) = 1 + sum_j prod_{i<=j} a_i and T(k) = c(k) + d k + o,
   where k = 0 is plain decoding (E = T = 1);
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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from tandem.runtime.backend import Backend


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

    config = getattr(backend, "config", None)
    # With one compute thread, CPU time is the steadiest measure on a busy machine (it
    # excludes time other processes take); with several, idle-spinning threads would
    # inflate it, so wall time it is.
    clock = time.process_time if getattr(config, "n_threads", None) == 1 else time.perf_counter

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


def load_cost_curve(backend: Backend, k_max: int = 8, *, cache_file: Path | None = None) -> CostCurve:
    """The cached c(k) for this model and machine, measuring it on first use."""
    from tandem.models.paths import cache_dir

    key = cost_curve_key(backend)
    file = cache_file or cache_dir() / "verify_cost.json"
    table: dict = {}
    if key is not None and file.exists():
        try:
            table = json.loads(file.read_text())
        except (OSError, ValueError):
            table = {}
        entry = table.get(key)
        if entry and len(entry.get("c", ())) > k_max:
            return CostCurve(tuple(entry["c"]), float(entry["t1_s"]))
    curve = measure_cost_curve(backend, k_max)
    if key is not None:
        table[key] = {"c": list(curve.c), "t1_s": curve.t1_s, "model": str(getattr(backend, "path", "")),
                      "machine": machine_id(), "measured_at": time.time()}
        tmp = file.with_suffix(".tmp")
        tmp.write_text(json.dumps(table, indent=1))
        tmp.replace(file)
    return curve


class LengthPolicy(Protocol):
    """Chooses the draft length each round and learns from the outcome."""

    stop_threshold: float | None

    def next_length(self) -> int: ...

    def trim(self, confidence: Sequence[float] | None, n: int, source: str = "") -> int:
        """How many of the ``n`` drafted tokens to verify (may be all, or none)."""
        ...

    def predraft_pays(self, n: int) -> bool:
        """Whether drafting the next round during the verification of ``n`` drafts is
        worth it (PEARL's pre-drafting, "where the acceptance outlook allows")."""
        ...

    def observe(
        self, drafted: int, accepted: int, draft_s: float, verify_s: float, round_s: float, source: str = "",
        *, timed: bool = True,
    ) -> None:
        """Learn from a round. ``timed=False``: the times are not representative (the
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

    def trim(self, confidence: Sequence[float] | None, n: int, source: str = "") -> int:
        return n

    def predraft_pays(self, n: int) -> bool:
        return True

    def observe(
        self, drafted: int, accepted: int, draft_s: float, verify_s: float, round_s: float, source: str = "",
        *, timed: bool = True,
    ) -> None:
        return None


@dataclass
class AdaptiveConfig:
    max_len: int = 8
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


@dataclass
class AdaptivePolicy:
    """Expected-throughput maximiser over c(k), acceptance and drafter cost."""

    cost: CostCurve
    config: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    draft_cost: float = 0.0
    """Drafter seconds per drafted token / seconds of a one-token target call."""
    overhead: float = 0.0
    """Per-round bookkeeping of a speculative round, relative to a one-token call."""
    cheap_drafter: bool = False
    """Model-free drafters cost ~nothing to ask: ask every round and let :meth:`trim`
    decide from the draft's own confidence whether verifying any of it pays."""
    cheap_sources: frozenset[str] = frozenset()
    """In a chain of model-free drafters ahead of a model drafter: the model-free
    sources. Their drafts are gated by :meth:`trim` and kept out of the model drafter's
    statistics; the model drafter gets :attr:`model_budget` tokens per round."""

    def __post_init__(self) -> None:
        n = self.config.max_len
        self.reached = np.zeros(n)
        self.accepted = np.zeros(n)
        self.stop_threshold = self.config.stop_threshold
        self.t1_s = self.cost.t1_s
        self._off_rounds = 0
        self._probe_gap = self.config.probe_every
        self.rounds_off = 0
        self.probes = 0
        self._calib_acc = 0.0
        self._calib_conf = 0.0
        self._last_conf: np.ndarray | None = None
        self.model_budget: int | None = None

    # -- model ------------------------------------------------------------------------
    def acceptance(self) -> np.ndarray:
        """Conditional acceptance a_i of drafted token i given the ones before accepted."""
        cfg = self.config
        return (self.accepted + cfg.prior_accept * cfg.prior_weight) / (self.reached + cfg.prior_weight)

    def expected_tokens(self, k: int, a: np.ndarray | None = None) -> float:
        a = self.acceptance() if a is None else a
        return 1.0 + float(np.sum(np.cumprod(a[:k])))

    def expected_time(self, k: int) -> float:
        return 1.0 if k == 0 else self.cost(k) + self.draft_cost * k + self.overhead

    def predicted_speedup(self, k: int) -> float:
        return self.expected_tokens(k) / self.expected_time(k)

    def best_length(self) -> int:
        a = self.acceptance()
        rates = [self.expected_tokens(k, a) / self.expected_time(k) for k in range(self.config.max_len + 1)]
        k = int(np.argmax(rates))
        return k if rates[k] >= self.config.min_gain else 0

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
        if self.cheap_drafter:
            return self.config.max_len  # asking is free; trim() decides what to verify
        k = self.best_length()
        k = self._on(k) if k > 0 else self._off(self.config.max_len)
        if self.cheap_sources:  # model-free drafters are always asked; the model gets k
            self.model_budget = k
            return self.config.max_len
        return k

    def trim(self, confidence: Sequence[float] | None, n: int, source: str = "") -> int:
        """How many of ``n`` drafted tokens to verify (cheap drafters only).

        Uses the draft's own per-token confidence (suffix-tree frequencies, drafter
        probabilities), calibrated against observed acceptance, where it has one, else
        the running per-position estimates; keeps the prefix maximising E(m)/T(m).
        """
        self._last_conf = None
        mixed = source in self.cheap_sources
        if not (self.cheap_drafter or mixed) or n == 0:
            return min(n, self.model_budget) if self.cheap_sources and self.model_budget is not None else n
        if confidence is not None:
            raw = np.asarray(confidence[:n], dtype=np.float64)
            a = np.clip(raw * self.calibration(), 0.0, 0.999)
            self._last_conf = raw
        else:
            a = self.acceptance()[:n]
        rates = [(1.0 + float(np.sum(np.cumprod(a[:m])))) / self.expected_time(m) for m in range(n + 1)]
        m = int(np.argmax(rates))
        pays = m > 0 and rates[m] >= self.config.min_gain
        if mixed:  # probing is the model drafter's business
            return m if pays else 0
        return self._on(m) if pays else self._off(n)

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

    def calibration(self) -> float:
        """Observed acceptances per unit of predicted confidence (decayed)."""
        return float(np.clip((self._calib_acc + 1.0) / (self._calib_conf + 1.0), 0.0, 1.5))

    def observe(
        self, drafted: int, accepted: int, draft_s: float, verify_s: float, round_s: float, source: str = "",
        *, timed: bool = True,
    ) -> None:
        if drafted == 0:
            return
        if source in self.cheap_sources:
            self._calibrate(drafted, accepted)
            return
        self.reached *= self.config.decay
        self.accepted *= self.config.decay
        tested = min(drafted, accepted + 1)
        self.reached[:tested] += 1.0
        self.accepted[:accepted] += 1.0
        self._calibrate(drafted, accepted)
        if not timed:
            return
        # One-token call time, from this verify and the cost curve; then relative costs.
        t1 = verify_s / self.cost(drafted)
        self.t1_s = 0.9 * self.t1_s + 0.1 * t1 if self.t1_s > 0 else t1
        if self.t1_s > 0:
            self.draft_cost = 0.8 * self.draft_cost + 0.2 * (draft_s / drafted / self.t1_s)
            extra = max(0.0, round_s - draft_s - verify_s) / self.t1_s
            self.overhead = 0.8 * self.overhead + 0.2 * extra

    def _calibrate(self, drafted: int, accepted: int) -> None:
        if self._last_conf is not None:
            tested = min(drafted, accepted + 1)
            self._calib_acc = self.config.decay * self._calib_acc + accepted
            self._calib_conf = self.config.decay * self._calib_conf + float(np.sum(self._last_conf[:tested]))
            self._last_conf = None
