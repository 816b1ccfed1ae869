"""Drafter and target on different devices (or CPU-thread groups), working at once.

Dovetail (algorithms.md §2) puts the drafter on one device and the target on another.
Here the two overlap through **pre-drafting** (PEARL's post-verify idea): while the
target verifies round r's draft ``d1..dk``, a background thread already drafts round
r+1 assuming every draft is accepted — it proposes ``b, e1..ek`` after ``context + d``,
where ``b`` is its guess of the target's bonus token. If the target accepts all k and
emits ``b``, round r+1 starts with ``e1..ek`` ready and no drafting time; otherwise the
pre-draft is dropped (the drafter's cache rolls back by common prefix, as it always
does). The target verifies every draft, so the output is exactly the target's.

llama.cpp's ``llama_decode`` runs without the GIL (ctypes releases it), so the two
threads really run in parallel. On a CPU-only machine the "devices" are thread groups:
``target_threads + draft_threads`` cores. :func:`calibrate` times each placement on a
short greedy run at first use and caches the winner in ``cache_dir()/split.json``.

:class:`WindowedDrafter` implements the planner's drafter context cap: the drafter
sees BOS plus a window of recent tokens that moves in half-window jumps, so its cache
is rebuilt once per half window instead of the drafter stopping when its context fills.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tandem.kernels.sampling import Sampler
from tandem.models import paths
from tandem.runtime.adaptive import FixedLength
from tandem.runtime.backend import Backend
from tandem.runtime.drafters.base import Draft, Drafter
from tandem.runtime.speculative import speculative


class WindowedDrafter:
    """Wrap a drafter so it only ever sees ``[BOS] + context[start:]`` (at most ``window``
    tokens); ``start`` advances by half a window when the context outgrows it."""

    def __init__(self, inner: Drafter, window: int, keep_first: int = 1) -> None:
        if window < 8:
            raise ValueError("a draft window needs at least 8 tokens")
        self.inner, self.window, self.keep_first = inner, window, keep_first
        self.name = f"{inner.name}@{window}"
        self._start = keep_first

    def _view(self, context: Sequence[int], room: int) -> list[int]:
        limit = self.window - room
        while len(context) - self._start + self.keep_first > limit:
            self._start += max(1, self.window // 2)
        if self._start > len(context):  # a new, shorter conversation
            self._start = self.keep_first
        return list(context[: self.keep_first]) + list(context[self._start:])

    def propose(self, context: Sequence[int], max_tokens: int, sampler: Sampler) -> Draft:
        if len(context) + max_tokens + 1 <= self.window:
            self._start = self.keep_first
        return self.inner.propose(self._view(context, max_tokens + 1), max_tokens, sampler)

    def commit(self, context: Sequence[int], n_accepted: int) -> None:
        self.inner.commit(self._view(context, 1), n_accepted)

    def close(self) -> None:
        self.inner.close()

    # Knobs and counters the speculative loop and the adaptive policy read or set on
    # model drafters pass through to the wrapped one.
    budget = property(lambda self: getattr(self.inner, "budget", None),
                      lambda self, v: setattr(self.inner, "budget", v))
    stop_threshold = property(lambda self: getattr(self.inner, "stop_threshold", None),
                              lambda self, v: setattr(self.inner, "stop_threshold", v))
    calls = property(lambda self: getattr(self.inner, "calls", 0))


@dataclass(frozen=True)
class Placement:
    """Where drafter and target run and whether they overlap."""

    name: str
    target_threads: int
    draft_threads: int
    predraft: bool
    draft_gpu: bool = False
    target_gpu: bool = False


def cpu_placements(cores: int) -> list[Placement]:
    """Placements worth trying on ``cores`` CPU cores: sequential (both use all cores)
    and parallel thread splits with pre-drafting."""
    out = [Placement("sequential", cores, cores, False)]
    for d in sorted({1, max(1, cores // 4)}):
        if cores - d >= 1:
            out.append(Placement(f"split {cores - d}+{d}", cores - d, d, True))
    out.append(Placement(f"overlap {cores}+1", cores, 1, True))
    return out


def gpu_placements(cores: int) -> list[Placement]:
    """Dovetail: draft on the GPU, verify on CPU threads; and the reverse."""
    return [Placement("draft-gpu", cores, 1, True, draft_gpu=True),
            Placement("target-gpu", 1, cores, True, target_gpu=True)]


def set_threads(backend: Backend, n: int) -> None:
    """Change a llama.cpp backend's thread count in place (no reload)."""
    ctx = getattr(backend, "_ctx", None)
    if ctx is not None and n > 0:
        import llama_cpp

        llama_cpp.llama_set_n_threads(ctx, n, n)


def split_speculative(drafter: Drafter, k: int, *, predraft: bool = True):
    """The speculative strategy with fixed draft length ``k`` and, when ``predraft``, the
    next round drafted in a background thread during verification (the device split).

    Stats: ``extra['predraft_hits']`` / ``['predraft_misses']`` count rounds that started
    with a ready draft or dropped one.
    """
    return speculative(drafter, FixedLength(k), predraft=predraft)


def _cache_file() -> Path:
    return paths.cache_dir() / "split.json"


def calibration_key(target: Backend, draft: Backend, placement_names: Sequence[str]) -> str:
    """Same models, same machine, same candidates -> the cached choice applies."""
    import os
    import platform

    def ident(b: Backend) -> str:
        p = getattr(b, "path", None)
        return f"{p}:{Path(p).stat().st_size}" if p and Path(p).exists() else b.name

    raw = "|".join([ident(target), ident(draft), platform.node(), str(os.cpu_count()), *placement_names])
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def measure_placement(target: Backend, drafter: Drafter, draft_backend: Backend, placement: Placement,
                      prompt: list[int], k: int, n_tokens: int = 24) -> float:
    """Greedy tokens/s of one placement on a short run."""
    from tandem.kernels.sampling import SamplingParams
    from tandem.runtime.generate import DoneEvent, generate

    set_threads(target, placement.target_threads)
    set_threads(draft_backend, placement.draft_threads)
    strategy = split_speculative(drafter, k, predraft=placement.predraft)
    start = time.perf_counter()
    out = 0
    for ev in generate(target, prompt, Sampler(SamplingParams(temperature=0.0)), strategy=strategy,
                       max_tokens=n_tokens, stop_at_eog=False):
        if isinstance(ev, DoneEvent):
            out = ev.stats.generated_tokens
    return out / max(time.perf_counter() - start, 1e-9)


@dataclass
class Calibration:
    best: str
    tokens_per_s: dict[str, float]


def calibrate(target: Backend, drafter: Drafter, draft_backend: Backend, placements: Sequence[Placement],
              prompt: list[int], k: int = 4, reps: int = 2, *, use_cache: bool = True) -> Calibration:
    """Pick the fastest placement (median of ``reps`` interleaved runs), cached on disk."""
    key = calibration_key(target, draft_backend, [p.name for p in placements])
    cache = _cache_file()
    data = json.loads(cache.read_text()) if cache.exists() else {}
    if use_cache and key in data:
        return Calibration(**data[key])
    runs: dict[str, list[float]] = {p.name: [] for p in placements}
    for _ in range(reps):  # interleaved so a busy machine hurts every placement alike
        for p in placements:
            runs[p.name].append(measure_placement(target, drafter, draft_backend, p, prompt, k))
    speeds = {name: sorted(v)[len(v) // 2] for name, v in runs.items()}
    result = Calibration(max(speeds, key=speeds.get), speeds)
    data[key] = asdict(result)
    cache.write_text(json.dumps(data, indent=1))
    return result
