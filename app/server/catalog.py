"""What ``GET /v1/models`` lists besides the served models: the local store's GGUF files.

Each comes with what a client needs to pick one — architecture, file size, trained
context length — and a memory estimate read from the GGUF header alone: weights plus
an f16 KV cache at a given context. The memory planner's own plan for this machine
(``tandem plan``: budget, KV type, compute buffers, whether it fits) takes seconds per
model, too slow for a listing clients fetch at start-up, so :class:`PlanCache` makes it
in the background, once per file version and machine, and the listing shows it when it
is ready. Plans are kept on disk (user cache dir), so a restarted server lists them at once.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tandem.errors import TandemError
from tandem.models.gguf_file import GGUFInfo, inspect_gguf
from tandem.models.paths import cache_dir, write_cache_file
from tandem.models.store import ModelEntry, list_models
from tandem.runtime.machine import (
    cache_key,
    code_stamp,
    file_version,
    machine_id,
    memory_bytes,
    software_id,
)
from tandem.runtime.planning.hardware import resolve_machine
from tandem.runtime.planning.plan import PlanRequest
from tandem.runtime.planning.planner import make_plan

PLAN_CTX = 4096
"""Context the estimate is priced at (``tandem run``'s default cap), or the trained one if smaller."""


def kv_bytes(info: GGUFInfo, n_ctx: int) -> int | None:
    """f16 K and V for every layer at ``n_ctx`` cells (``None`` if the header lacks a size)."""
    shape = info.shape()
    if min(shape.n_layer, shape.n_embd, shape.n_head_kv, shape.head_dim) <= 0:
        return None
    return shape.kv_bytes_per_token() * n_ctx


PENDING = {"status": "pending"}


def plan_summary(path: Path) -> dict[str, Any]:
    """The planner's plan for ``path`` alone on this machine, as the listing shows it."""

    try:
        plan = make_plan(PlanRequest(path, None, None, resolve_machine(None, None, None, measure_bandwidth=False)))
    except TandemError as exc:
        return {"status": "error", "error": str(exc)}
    return {"status": "ready", "fits": plan.fits, "n_ctx": plan.target.n_ctx, "type_k": plan.target.type_k,
            "type_v": plan.target.type_v, "n_gpu_layers": plan.target.n_gpu_layers,
            "host_bytes": plan.host_total, "host_budget_bytes": plan.host_budget,
            "predicted_tokens_per_s": round(plan.tokens_per_s, 1)}


def machine_and_code() -> str:
    """What a plan depends on besides the file: this machine (CPU, memory, kernel, Python,
    packages) and Tandem's own code (the planner's rules)."""
    return cache_key(machine_id(), memory_bytes(), software_id(), code_stamp())


class PlanCache:
    """Planner results per file version ``(path, mtime, size)`` and machine, made one at a
    time on a background thread and kept in ``folder`` (default: the user cache dir's
    ``plans``) across restarts; :meth:`get` never waits for a plan."""

    def __init__(self, make: Any = plan_summary, folder: Path | None = None) -> None:
        self._make = make
        self._folder = folder
        self._done: dict[str, dict[str, Any]] = {}
        self._pending: set[str] = set()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-plans")
        self._machine: str | None = None

    def get(self, path: Path) -> dict[str, Any]:
        key = file_version(path)
        with self._lock:
            if key in self._done:
                return self._done[key]
        kept = self._load(key)  # made before a restart: listed at once
        with self._lock:
            if kept is not None:
                self._done[key] = kept
                return kept
            if key not in self._pending:
                self._pending.add(key)
                self._pool.submit(self._run, key, path)
        return PENDING

    def _load(self, key: str) -> dict[str, Any] | None:
        try:
            kept = json.loads(self._file(key).read_text())
        except (OSError, ValueError):  # not planned on this machine yet, or a damaged file
            return None
        return kept if isinstance(kept, dict) and kept.get("status") == "ready" else None

    def _file(self, key: str) -> Path:
        if self._machine is None:
            self._machine = machine_and_code()
        name = cache_key(key, self._machine)
        return (self._folder or cache_dir() / "plans") / f"{name}.json"

    def _run(self, key: str, path: Path) -> None:
        try:
            result = self._make(path)
        except Exception as exc:  # a planner failure is shown, never raised into a request
            result = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
        if result.get("status") == "ready":
            write_cache_file(self._file(key), json.dumps(result))
        with self._lock:
            self._done[key] = result
            self._pending.discard(key)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def store_model(entry: ModelEntry, plans: PlanCache | None = None) -> dict[str, Any]:
    """One ``/v1/models`` item for a store file that this server does not serve."""
    meta: dict[str, Any] = {"served": False, "source": entry.source.split(":")[0], "architecture": entry.architecture,
                            "size_bytes": entry.size_bytes}
    try:
        info = inspect_gguf(entry.path)
    except TandemError as exc:
        meta["error"] = str(exc)
        return {"id": entry.name, "object": "model", "owned_by": "tandem", "meta": meta}
    trained = info.arch_value("context_length")
    ctx = min(PLAN_CTX, trained) if isinstance(trained, int) and trained > 0 else PLAN_CTX
    kv = kv_bytes(info, ctx)
    meta.update(context_length=trained, memory_plan={
        "n_ctx": ctx, "weights_bytes": info.weights_bytes, "kv_cache_bytes": kv,
        "total_bytes": info.weights_bytes + kv if kv is not None else None})
    if plans is not None:
        meta["planner"] = plans.get(entry.path)
    return {"id": entry.name, "object": "model", "owned_by": "tandem", "meta": meta}


def store_models(served: set[str], plans: PlanCache | None = None) -> list[dict[str, Any]]:
    """Store models not among ``served`` (their ids), in store order."""
    return [store_model(e, plans) for e in list_models() if e.name not in served]
