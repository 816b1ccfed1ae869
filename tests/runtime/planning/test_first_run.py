"""A first run measures side by side: the plan starts every child it will wait for (the
machine's baseline, llama.cpp's sizes of each model) at once, and none when cached."""

from __future__ import annotations

import shutil
from pathlib import Path

import tandem.runtime.planning.baseline as baseline
from tandem.runtime.planning import llama_sizes
from tandem.runtime.planning.plan import PlanRequest
from tandem.runtime.planning.planner import _measure_soon, make_plan


def test_children_start_together_and_their_answers_are_kept(stories260k: Path, tmp_path: Path, monkeypatch) -> None:
    target, draft = tmp_path / "t.gguf", tmp_path / "d.gguf"
    shutil.copy(stories260k, target)
    shutil.copy(stories260k, draft)
    monkeypatch.setattr(baseline, "_CACHED", None)
    monkeypatch.setattr(baseline, "_PENDING", None)
    req = PlanRequest(target, draft, 256, None, threads=1)
    try:
        _measure_soon(req)
        sizes = [llama_sizes.sizes_for(m) for m in (target, draft)]
        assert all(s._proc is not None for s in sizes)  # both sizing children already running
        assert baseline._PENDING is not None  # and the baseline's
        plan = make_plan(req)  # reads what they measured
    finally:
        llama_sizes.close_all()
    assert plan.fits and baseline._PENDING is None
    assert baseline.cache_file().exists()
    assert all(llama_sizes.cache_path(m).exists() for m in (target, draft))
    monkeypatch.setattr(baseline, "_CACHED", None)
    _measure_soon(req)  # everything cached now: nothing starts
    try:
        assert baseline._PENDING is None
        assert all(llama_sizes.sizes_for(m)._proc is None for m in (target, draft))
    finally:
        llama_sizes.close_all()
