"""`tandem bench --gpu --vram SIZE`'s placements section, on the CPU: every placement the
planner compares is opened as `tandem run --offload NAME` opens it and timed against
llama-cpp-python at the most GPU layers of the target alone that fit the budget
(llama.cpp's CPU build runs a layer "on the GPU" on the CPU, so the logic runs here; the
figures mean nothing). SmolLM2-135M is target and drafter, on this machine seen by the
planner as a laptop with a GPU with room for most of it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tandem.app.bench import placements
from tandem.app.bench.gpu import format_gpu, plot_gpu
from tandem.app.bench.placements import (
    PEER,
    PlacementBenchConfig,
    bench_placements,
    engine_spec,
    format_placements,
    peer_gpu_layers,
    runs_for,
)
from tandem.app.cli import main
from tandem.runtime.planning import hardware
from tandem.runtime.planning.hardware import resolve_machine
from tandem.runtime.planning.plan import PlanRequest
from tandem.runtime.planning.planner import make_plan

PROFILE = "rtx3060-laptop"
VRAM = "700MiB"
"""SmolLM2-135M with itself as drafter: the drafter and 30 of the target's 31 layers fit."""


@pytest.fixture(autouse=True)
def gpu_laptop(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine, to the planner, is the profile's laptop with its GPU (whatever this
    machine has): what `tandem run` and the bench plan for is then what they compare."""
    monkeypatch.setattr(hardware, "detect", lambda **_: hardware.from_profile(PROFILE))


@pytest.fixture(scope="module")
def machine():
    return resolve_machine(PROFILE, None, VRAM)


def _cfg(real_models, vram: str = VRAM, **kw) -> PlacementBenchConfig:
    lines: list[str] = []
    defaults = dict(ctx=512, threads=1, n_tokens=4, prompts=1, reps=1, log=lines.append)
    return PlacementBenchConfig(real_models.smollm2, real_models.smollm2, vram, **{**defaults, **kw})


def test_runs_are_the_peer_and_each_placement_the_planner_compared(real_models, machine) -> None:
    plan = make_plan(PlanRequest(real_models.smollm2, real_models.smollm2, 512, machine, drop_slow_draft=False))
    runs = runs_for(plan, machine)
    assert runs[0].name == PEER and runs[0].option is None
    assert [r.option for r in runs[1:]] == [o for o in plan.placements if o.fits and o.allowed]
    assert {r.option.pin for r in runs[1:]} >= {"a", "b"}
    assert all(r.name.startswith(f"{r.option.pin}. ") for r in runs[1:])
    # The target alone takes at least the layers it gets next to the drafter.
    a = next(o for o in plan.placements if o.key == "a")
    assert runs[0].peer_layers == peer_gpu_layers(plan, machine)
    assert runs[0].peer_layers < 0 or runs[0].peer_layers >= a.n_gpu_layers


def test_each_placement_is_opened_through_open_engine_pinned(real_models, monkeypatch) -> None:
    """One engine per placement, from `tandem run`'s spec with ``--offload`` its name,
    planned as that placement; its plain runs reuse it (no second load)."""
    real = placements.open_engine
    opened = []

    def recording(spec, *args, **kw):
        engine = real(spec, *args, **kw)
        opened.append((spec, engine.plan, engine.describe()))
        return engine

    monkeypatch.setattr(placements, "open_engine", recording)
    res = bench_placements(_cfg(real_models))
    rows = {row["offload"]: row for row in res["rows"][1:]}
    assert rows and all("error" not in row for row in rows.values()), res
    assert sorted(spec.offload for spec, _, _ in opened) == sorted(rows)  # each once, and nothing else opened
    base = engine_spec(_cfg(real_models), 1)
    for spec, plan, described in opened:
        assert spec == replace(base, offload=spec.offload)
        (chosen,) = [o for o in plan.placements if o.chosen]
        assert chosen.pin == spec.offload and described["offload"] == spec.offload
        row = rows[spec.offload]
        assert (plan.target.n_gpu_layers, plan.target.type_k) == (row["n_gpu_layers"], row["type_k"])
        assert plan.draft is not None and plan.draft.n_gpu_layers == row["draft_gpu_layers"]
        assert "opened_n_gpu_layers" not in row
        assert set(row["tok_s"]) == {"plain", "speculative"}


def test_each_placement_is_timed_against_llama_cpp(real_models) -> None:
    res = bench_placements(_cfg(real_models, reps=3, deadline_s=0.0))
    assert res["reps"] == 1 and "deadline" in res["stopped"]  # the first repetition always runs
    rows = res["rows"]
    assert rows[0]["name"] == PEER and set(rows[0]["tok_s"]) == {"plain"}
    assert rows[0]["ratio_to_llama"]["plain"] == 1.0
    for row in rows[1:]:
        assert "error" not in row, row
        assert set(row["tok_s"]) == {"plain", "speculative"} and row["tok_s"]["plain"]["median"] > 0
        assert row["ratio_to_llama"]["plain"] == pytest.approx(
            row["tok_s"]["plain"]["median"] / rows[0]["tok_s"]["plain"]["median"], abs=1e-3)
        assert row["predicted_tok_s"]["speculative"] >= row["predicted_tok_s"]["plain"] > 0
    assert sum(row["chosen"] for row in rows) == 1
    text = "\n".join(format_placements(res))
    assert text.count("<- planner's pick") == 1 and "ratio to plain llama.cpp partial offload" in text
    assert "past the 0 s deadline" in text


def test_a_configuration_that_fails_leaves_its_error_and_the_others_run(real_models, monkeypatch) -> None:
    real = placements._time_block

    def failing(run, *args):
        if run.option is not None and run.option.key == "b":
            raise RuntimeError("cudaMalloc failed: out of memory\nsecond line")
        return real(run, *args)

    monkeypatch.setattr(placements, "_time_block", failing)
    res = bench_placements(_cfg(real_models))
    (b,) = [row for row in res["rows"] if row.get("key") == "b"]
    assert b["error"] == "RuntimeError: cudaMalloc failed: out of memory" and b["tok_s"] == {}
    assert all(row["tok_s"] for row in res["rows"] if row is not b)
    assert "failed: RuntimeError: cudaMalloc failed" in "\n".join(format_placements(res))


def test_a_target_that_fits_the_budget_is_skipped_with_the_reason(real_models) -> None:
    res = bench_placements(_cfg(real_models, vram="4GiB"))
    assert "fits the GPU budget whole" in res["skipped"] and res["n_gpu_layers"] == -1
    assert format_placements(res)[0].startswith("[5] placements: skipped")


def test_the_gpu_report_shows_the_section_only_when_asked(real_models, tmp_path) -> None:
    section = bench_placements(_cfg(real_models))
    base = {"device": "CPU", "target": "t.gguf", "n_tokens": 4, "reps": 1, "threads": 1, "seconds": 1.0,
            "plain": {"error": "x"}, "cost": {"error": "x"}, "end_to_end": {"error": "x"}}
    assert "[5]" not in format_gpu(base)
    text = format_gpu({**base, "placements": section})
    assert "[5] bigger than the card" in text and "<- planner's pick" in text
    assert "[5] placements: failed: boom" in format_gpu({**base, "placements": {"error": "boom"}})
    pytest.importorskip("matplotlib")  # the [plots] extra
    png = tmp_path / "gpu.png"
    plot_gpu({**base, "end_to_end": {}, "placements": section}, png)  # sections 1-4 failed: section 5 alone
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_vram_needs_gpu_and_a_size(real_models, capsys) -> None:
    assert main(["bench", "-m", str(real_models.smollm2), "--vram", "3GiB"]) != 0
    assert "--vram goes with --gpu" in capsys.readouterr().err
    assert main(["bench", "--gpu", "-m", str(real_models.smollm2), "--vram", "lots"]) != 0
    assert "Cannot read the size 'lots'" in capsys.readouterr().err
