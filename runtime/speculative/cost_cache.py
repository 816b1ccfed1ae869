"""Measured costs kept per model, settings and machine (the user cache dir's
``verify_cost.json``): the c(k) a run measured or learnt, and a model drafter's cost per
drafted token and per token it catches up on once rounds timed them. A fresh strategy starts from them instead of a prior,
so nothing is measured twice and a drafter that cannot pay here is not probed again.
Writes are atomic and best effort: a read-only cache dir only means starting from the
prior again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from tandem.models.paths import cache_dir, write_cache_file
from tandem.runtime.backends.protocol import Backend
from tandem.runtime.machine import cache_key, file_version, machine_id
from tandem.runtime.speculative.cost import CostCurve, measure_cost_curve, merge_runs


def cost_curve_key(backend: Backend) -> str | None:
    """Cache key: the model file (path, size, mtime), the settings that change its speed
    (:meth:`~tandem.runtime.backends.protocol.Backend.compute_settings`) and the machine."""
    compute = backend.compute_settings()
    if compute.model_file is None:
        return None
    try:
        version = file_version(compute.model_file)
    except OSError:  # the file is gone: nothing to key on
        return None
    return cache_key(version, compute.settings, machine_id(), "v5")


def _cost_table(file: Path) -> dict:
    try:
        return json.loads(file.read_text()) if file.exists() else {}
    except (OSError, ValueError):
        return {}


def _cost_file(cache_file: Path | None) -> Path:
    return cache_file or cache_dir() / "verify_cost.json"


def _cached_entry(key: str | None, cache_file: Path | None) -> dict | None:
    """The cost cache's entry under ``key`` (none when the cache folder cannot be made:
    decoding then starts from the prior)."""
    if key is None:
        return None
    try:
        return _cost_table(_cost_file(cache_file)).get(key)
    except OSError:
        return None


def cached_cost_curve(backend: Backend, k_max: int = 8, *, cache_file: Path | None = None) -> CostCurve | None:
    """The c(k) cached for this model, settings and machine (measured or learnt), if any."""
    entry = _cached_entry(cost_curve_key(backend), cache_file)
    if entry and len(entry.get("c", ())) > k_max:
        return CostCurve(tuple(entry["c"]), float(entry["t1_s"]))
    return None


def remember_cost_curve(backend: Backend, curve: CostCurve, observed: Mapping[int, float] | None = None, *,
                        cache_file: Path | None = None) -> None:
    """Cache ``curve`` for this model, settings and machine (atomic write; best effort:
    a read-only cache dir only means the next run starts from the prior again).
    ``observed``: a run's own c(k) per size it called, merged with the earlier runs'
    (:func:`~tandem.runtime.speculative.cost.merge_runs`); without it ``curve`` is saved
    as measured."""
    key = cost_curve_key(backend)
    if key is None:
        return
    history: dict[int, list[float]] = {}
    if observed is not None:
        saved, past = _saved_runs(_cached_entry(key, cache_file))
        curve, history = merge_runs(saved, past, curve, observed)
    _store(key, {"c": list(curve.c), "t1_s": curve.t1_s, "runs": {str(k): v for k, v in history.items()},
                 "model": str(backend.compute_settings().model_file)}, cache_file)


def _saved_runs(entry: dict | None) -> tuple[CostCurve | None, dict[int, list[float]]]:
    """An entry's saved curve and per-size run history (nothing, from one another
    version wrote or that was damaged)."""
    try:
        saved = CostCurve(tuple(float(x) for x in entry["c"]), float(entry["t1_s"])) if entry else None
        past = {int(k): [float(x) for x in v] for k, v in (entry or {}).get("runs", {}).items()}
        return saved, past
    except (KeyError, TypeError, ValueError, AttributeError):
        return None, {}


def _store(key: str, entry: dict, cache_file: Path | None) -> None:
    """Write one entry of the cost cache (:func:`~tandem.models.paths.write_cache_file`)."""
    file = _cost_file(cache_file)
    table = _cost_table(file)
    table[key] = entry | {"machine": machine_id(), "measured_at": time.time()}
    write_cache_file(file, json.dumps(table, indent=1))


def _draft_cost_key(target: Backend, drafter_name: str, drafter_bytes: int) -> str | None:
    key = cost_curve_key(target)
    if key is None:
        return None
    return "draft:" + cache_key(key, drafter_name, drafter_bytes)


@dataclass(frozen=True)
class DrafterCosts:
    """What runs learnt of a model drafter next to a target, in one-token target calls."""

    draft_cost: float | None
    """Per drafted token (``None``: never timed; a guess stands in,
    :func:`~tandem.runtime.speculative.factory.guessed_draft_cost`)."""
    catch_up_cost: float | None = None
    """Per token caught up on in one batched call (``None``: never timed)."""
    call_cost: float | None = None
    """One call of the drafter's model, timed at a strategy's start while ``draft_cost``
    was not known (the guess's floor): kept so later runs do not time it again."""

    def known(self) -> bool:
        """Anything measured to keep."""
        return any(cost is not None for cost in (self.draft_cost, self.catch_up_cost, self.call_cost))


def cached_drafter_costs(target: Backend, drafter_name: str, drafter_bytes: int, *,
                         cache_file: Path | None = None) -> DrafterCosts | None:
    """A model drafter's costs as an earlier run with this target, drafter and machine
    learnt them, if any. A fresh strategy starts from them instead of the drafter's weight
    share: a drafter that cannot pay here (a cross-vocabulary one whose text translation
    costs more than its weights suggest) is then never probed, where each new conversation
    used to pay a probe and its catch-up to learn that again."""
    entry = _cached_entry(_draft_cost_key(target, drafter_name, drafter_bytes), cache_file)
    if not entry:
        return None
    costs = DrafterCosts(*(float(v) if (v := entry.get(name)) else None
                           for name in ("draft_cost", "catch_up_cost", "call_cost")))
    return costs if costs.known() else None


def times_drafter_call(given_draft_cost: float | None, learnt: DrafterCosts | None,
                       target_step_s: float | None) -> bool:
    """Whether a strategy's first cost guess times one call of the drafter's model
    (:func:`~tandem.runtime.speculative.factory.drafter_call_cost`): when neither the
    options nor an earlier run know the drafter's cost, and the target's one-token step
    (from its cached cost curve) is there to compare that call with. The engine builder
    opens a deferred drafter at once in that case (the call needs the model)."""
    known = given_draft_cost or (learnt is not None and (learnt.draft_cost or learnt.call_cost))
    return not known and bool(target_step_s)


def remember_drafter_costs(target: Backend, drafter_name: str, drafter_bytes: int, costs: DrafterCosts, *,
                           cache_file: Path | None = None) -> None:
    """Cache what a run learnt of a model drafter's costs (best effort, atomic)."""
    key = _draft_cost_key(target, drafter_name, drafter_bytes)
    if key is not None and costs.known():
        _store(key, asdict(costs) | {"drafter": drafter_name}, cache_file)


def load_cost_curve(backend: Backend, k_max: int = 8, *, cache_file: Path | None = None) -> CostCurve:
    """The cached c(k) for this model and machine, measuring it (about two seconds) on
    first use. Benchmarks use it; decoding starts from :func:`cached_cost_curve` or a
    prior and learns online instead (:class:`OnlineCost`)."""
    curve = cached_cost_curve(backend, k_max, cache_file=cache_file)
    if curve is None:
        curve = measure_cost_curve(backend, k_max)
        remember_cost_curve(backend, curve, cache_file=cache_file)
    return curve
