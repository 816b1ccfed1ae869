"""Drafter placement chosen from measured per-device costs: the round model, the choice,
the calibration on a real pair (cached), and `tandem run` following it losslessly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.errors import TandemError
from tandem.kernels.acceptance import expected_tokens
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_config import LlamaConfig
from tandem.runtime.planning.calibration import calibrate, place
from tandem.runtime.planning.placement import (
    Costs,
    Option,
    choose,
    options,
    predict,
    target_gpu_fits,
)
from tandem.runtime.planning.planner import plan_for_run


def _costs(gpu_step: float, cpu_step: float, verify: float = 0.040, alpha: float = 0.8,
           gpu_verify: float = 0.030) -> Costs:
    """Costs for every option of ``options(("cuda", "cpu"), 8, target_gpu=True)``: fewer
    threads, slower."""
    return Costs(decode_s={"cpu/8": 0.010, "cpu/7": 0.011, "cpu/6": 0.012, "cuda": 0.008},
                 verify_s={"cpu/8": verify, "cpu/7": verify * 1.1, "cpu/6": verify * 1.2, "cuda": gpu_verify},
                 draft_s={"cuda": gpu_step, "cpu/8": cpu_step, "cpu/2": cpu_step * 2, "cpu/1": cpu_step * 3},
                 acceptance={"cuda": alpha, "cpu": alpha})


def test_options_cover_devices_and_thread_splits() -> None:
    names = [o.name for o in options(("cuda", "cpu"), 8)]
    assert names == ["drafter on GPU, pre-drafting", "drafter on GPU", "drafter on CPU, sequential",
                     "CPU split 7+1, pre-drafting", "CPU split 6+2, pre-drafting"]
    reverse = [o for o in options(("cuda", "cpu"), 8, target_gpu=True) if o.target_device == "cuda"]
    assert [o.draft_device for o in reverse] == ["cpu", "cpu"] and {o.predraft for o in reverse} == {True, False}
    assert [o.name for o in options(("cpu",), 1)] == ["drafter on CPU, sequential"]
    assert all(o.target_threads + o.draft_threads <= 8 for o in options(("cpu",), 8) if o.predraft)


def test_round_model() -> None:
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    costs = _costs(gpu_step=0.002, cpu_step=0.004, verify=0.040, alpha=1.0)
    seq = Option("s", "cuda", 8, 8, False)
    pre = Option("p", "cuda", 8, 8, True)
    assert predict(seq, costs) == pytest.approx(5 / (4 * 0.002 + 0.040))
    # Every round accepted: the next round's drafting hides behind verification.
    assert predict(pre, costs) == pytest.approx(5 / 0.040)
    # Nothing accepted: pre-drafts never hit, a round costs what a sequential one does.
    costs.acceptance["cuda"] = 0.0
    assert predict(pre, costs) == pytest.approx(predict(seq, costs))


def test_choice_follows_the_measured_costs() -> None:
    opts = options(("cuda", "cpu"), 8, target_gpu=True)
    fast_gpu_draft = _costs(gpu_step=0.001, cpu_step=0.004, gpu_verify=0.060)
    assert choose(opts, fast_gpu_draft).option.name == "drafter on GPU, pre-drafting"
    # A GPU whose launches cost more than the CPU drafter (a weak iGPU, a busy card) loses.
    slow_gpu = choose(opts, _costs(gpu_step=0.050, cpu_step=0.002, gpu_verify=0.060))
    assert slow_gpu.option.draft_device == "cpu" and slow_gpu.option.target_device == "cpu"
    assert slow_gpu.predicted[slow_gpu.option.name] == max(slow_gpu.predicted.values())
    # The reverse (Dovetail's other direction): a GPU that verifies fast takes the target.
    reverse = choose(opts, _costs(gpu_step=0.050, cpu_step=0.002, gpu_verify=0.012))
    assert reverse.option.target_device == "cuda" and reverse.option.draft_device == "cpu"
    assert reverse.plain == pytest.approx(1 / 0.008)


@pytest.fixture()
def target(stories_twin: Path):
    with LlamaCppBackend(stories_twin, LlamaConfig(n_ctx=512, n_threads=2)) as backend:
        yield backend


def test_calibration_on_a_real_pair_is_measured_once_and_cached(target, stories_twin: Path, stories260k: Path,
                                                                isolated_home: Path, monkeypatch) -> None:
    import tandem.runtime.planning.calibration as calibration
    import tandem.runtime.planning.placement as placement

    monkeypatch.setattr(placement, "MIN_SPLIT_THREADS", 2)  # a 2-core box has one option otherwise
    plan = plan_for_run(stories_twin, stories260k, ctx=512, threads=2, drop_slow_draft=False)
    opts = options(("cpu",), 2)
    first = calibrate(target, plan, opts, mode="model", notify=lambda _: None)
    c = first.costs
    assert set(c.decode_s) == set(c.verify_s) == {"cpu/1", "cpu/2"}
    assert set(c.draft_s) == {"cpu/1", "cpu/2"}
    assert all(v > 0 for v in [*c.decode_s.values(), *c.verify_s.values(), *c.draft_s.values()])
    # The twin computes the drafter's own function (q8_0 rounding aside): drafts agree.
    assert c.acceptance["cpu"] > 0.8
    assert first.option.name in first.predicted and not first.cached
    assert len(target.tokens) == 0  # the target comes back empty for the real run
    assert (isolated_home / "cache" / "placement.json").exists()

    def no_measuring(*args, **kwargs):
        raise AssertionError("a cached calibration must not measure again")

    monkeypatch.setattr(calibration, "measure_target", no_measuring)
    again = calibrate(target, plan, opts, mode="model")
    assert again.cached and again.costs == first.costs and again.option == first.option
    # Placed otherwise by llama.cpp (another --offload), the costs are another pair's.
    from dataclasses import replace

    key = calibration.calibration_key(plan, opts, "model")
    for moved in (replace(plan, target=replace(plan.target, n_gpu_layers=5)),
                  replace(plan, draft=replace(plan.draft, n_gpu_layers=-1)),
                  replace(plan, target=replace(plan.target, type_k="q8_0", type_v="q8_0"))):
        assert calibration.calibration_key(moved, opts, "model") != key

    # Costs cached in an older layout (keys without the device) are measured again, not a crash.
    monkeypatch.undo()
    cache = isolated_home / "cache" / "placement.json"
    data = json.loads(cache.read_text())
    for costs in data.values():
        costs["verify_s"] = {k.split("/")[-1]: v for k, v in costs["verify_s"].items()}
    cache.write_text(json.dumps(data))
    remeasured = calibrate(target, plan, opts, mode="model", notify=lambda _: None)
    assert not remeasured.cached and set(remeasured.costs.verify_s) == {"cpu/1", "cpu/2"}


def test_place_applies_the_choice_and_refuses_a_device_the_plan_lacks(target, stories_twin: Path,
                                                                      stories260k: Path, monkeypatch) -> None:
    import tandem.runtime.planning.placement as placement

    monkeypatch.setattr(placement, "MIN_SPLIT_THREADS", 2)  # so two threads make a choice to calibrate
    one_thread = plan_for_run(stories_twin, stories260k, ctx=512, threads=1, drop_slow_draft=False)
    placed = place(target, one_thread, mode="model", device="cpu")  # device="cpu": the same on a GPU machine
    assert placed.choice is None and placed.draft_device == "cpu" and placed.predraft is False
    assert placed.llama_config.n_threads == 1 and placed.draft_path == one_thread.draft.path
    assert placed.target is target
    from dataclasses import replace

    cpu_only = replace(one_thread, draft=replace(one_thread.draft, devices=("cpu",)))  # as on a machine with no GPU
    with pytest.raises(TandemError, match="cannot run on the GPU"):
        place(target, cpu_only, device="gpu")
    two = plan_for_run(stories_twin, stories260k, ctx=512, threads=2, drop_slow_draft=False)
    chosen = place(target, two, mode="model", device="cpu", notify=lambda _: None)
    assert chosen.choice is not None and chosen.target is target
    assert chosen.llama_config.n_threads == chosen.choice.option.draft_threads
    assert chosen.predraft == chosen.choice.option.predraft


def test_target_on_gpu_needs_a_cuda_gpu_and_room(stories_twin: Path, stories260k: Path, monkeypatch) -> None:
    """The torch engine's target on the GPU, next to a llama.cpp that keeps it on the CPU
    (a CUDA build of llama.cpp would take the layers itself: as if it were a CPU build)."""
    import torch

    from tandem.runtime.backends import llama_devices

    monkeypatch.setattr(llama_devices, "gpu_offload_build", lambda: False)
    plan = plan_for_run(stories_twin, stories260k, ctx=512, threads=2, drop_slow_draft=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not target_gpu_fits(plan)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    from dataclasses import replace

    assert target_gpu_fits(replace(plan, vram_budget=8 * 1024**3))
    assert not target_gpu_fits(replace(plan, vram_budget=1024**2))  # the float32 target does not fit
    assert not target_gpu_fits(replace(plan, vram_budget=0))


def test_run_on_a_small_cpu_measures_nothing_and_stays_lossless(stories_twin: Path, stories260k: Path) -> None:
    """On a CPU-only machine with few cores there is one placement (in turn): the first
    run with a new pair starts decoding at once, with the same tokens as plain."""
    def run(*extra: str) -> dict:
        cmd = [sys.executable, "-m", "tandem.app.cli", "run", "-m", str(stories_twin), "-p", "Once upon a time",
               "-n", "48", "--threads", "2", "--ctx", "512", "--json", "--raw", *extra]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        return json.loads(out.stdout)

    plain = run("--draft-mode", "off")
    spec = run("--draft", str(stories260k), "--draft-mode", "model", "--placement", "cpu")
    assert spec["token_ids"] == plain["token_ids"]
    assert "placement" not in spec  # nothing to choose between, nothing measured
    assert spec["speculation"]["predraft"] is False
