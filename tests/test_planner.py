"""The planner: choices, refusals with suggestions, JSON output, and the budget promise
checked against resident memory sampled during a long multi-turn chat."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tandem.app.cli import main
from tandem.models.errors import BudgetError
from tandem.runtime.hardware import MiB, resolve_machine
from tandem.runtime.planner import SAFETY, PlanRequest, make_plan

ALPHA = 0.95
"""stories260K drafting for its own twin accepts (nearly) every token: measured in test_split."""


def _plan(target: Path, draft: Path | None, budget, ctx: int | None = 512, **kw):
    """Plan on this machine's CPU and RAM (a GPU this machine may have is set aside, so the
    figures are the same on every test machine) or on a named profile (``profile=``)."""
    from dataclasses import replace

    machine = resolve_machine(budget=budget, measure_bandwidth=False, **kw)
    if machine.source == "detected":
        machine = replace(machine, gpus=(), vram_budget=0)
    return make_plan(PlanRequest(target, draft, ctx, machine, acceptance=ALPHA, baseline=40 * MiB))


def test_roomy_budget_keeps_the_full_drafter(stories_twin: Path, stories260k: Path) -> None:
    plan = _plan(stories_twin, stories260k, "1GiB")
    assert plan.fits and plan.speculate
    assert plan.draft is not None and plan.draft.window is None
    assert plan.target.n_ctx == 512 + plan.draft_max
    assert plan.host_total <= plan.host_budget
    assert plan.memory.speculation_extra() > 0
    assert any("drafter" in r for r in plan.reasons)


def test_tight_budget_shrinks_the_drafter_not_the_context(stories_twin: Path, stories260k: Path) -> None:
    full = _plan(stories_twin, stories260k, "1GiB")
    alone = _plan(stories_twin, None, "1GiB")
    # Between "target alone" and "target + full drafter": something must give.
    budget = int((alone.host_total + full.host_total) / 2 / (1 - SAFETY))
    plan = _plan(stories_twin, stories260k, budget)
    assert plan.fits
    assert plan.target.n_ctx >= 512  # the user's context is kept
    assert plan.target.type_k == "f16"  # and the target's KV untouched
    assert plan.host_total <= budget * (1 - SAFETY)
    assert plan.draft is None or plan.draft.window is not None or plan.draft_max < full.draft_max
    assert plan.memory.speculation_extra() < full.memory.speculation_extra()


def test_impossible_budget_is_refused_with_suggestions(stories_twin: Path, stories260k: Path) -> None:
    alone = _plan(stories_twin, None, "1GiB", ctx=2048)
    budget = int(alone.baseline + 0.8 * (alone.host_total - alone.baseline))
    plan = _plan(stories_twin, stories260k, budget, ctx=2048)
    assert not plan.fits
    assert any(s.startswith("--ctx ") for s in plan.suggestions)
    assert any(s.startswith("--budget ") for s in plan.suggestions)
    with pytest.raises(BudgetError, match="What would fit"):
        plan.check()
    # The suggested context really fits.
    ctx = int(next(s for s in plan.suggestions if s.startswith("--ctx ")).split()[1])
    again = _plan(stories_twin, None, budget, ctx=ctx)
    assert again.fits and again.target.n_ctx >= ctx


def test_default_context_shrinks_with_a_reason(stories_twin: Path) -> None:
    big = _plan(stories_twin, None, "1GiB", ctx=None)
    small = _plan(stories_twin, None, int(_plan(stories_twin, None, "1GiB", ctx=256).host_total / (1 - SAFETY)) + MiB,
                  ctx=None)
    assert small.fits and small.target.n_ctx < big.target.n_ctx
    assert any("default context" in r for r in small.reasons)


def test_gpu_profile_offloads_and_partial_vram_splits_layers(stories_twin: Path, stories260k: Path) -> None:
    machine = resolve_machine("rtx3060-laptop")
    plan = make_plan(PlanRequest(stories_twin, stories260k, 512, machine, acceptance=ALPHA))
    assert plan.fits and plan.target.n_gpu_layers == -1
    assert 0 < plan.memory.gpu <= plan.vram_budget
    # A GPU with room for only part of the target: some layers stay on the CPU.
    full_gpu = plan.memory.total("gpu", "target")
    tight = resolve_machine("rtx3060-laptop", vram=int((full_gpu + 350 * MiB) * 0.9))
    part = make_plan(PlanRequest(stories_twin, None, 512, tight, acceptance=ALPHA))
    n_layer = 6
    assert part.fits and 0 <= part.target.n_gpu_layers < n_layer
    assert part.memory.gpu <= part.vram_budget


def test_cli_json_schema(stories_twin: Path, stories260k: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A roomy budget: this process's own resident memory is the baseline, and on a GPU
    # machine earlier tests may have left a CUDA context and models in it.
    rc = main(["plan", "-m", str(stories_twin), "--draft", str(stories260k), "--ctx", "512", "--budget", "32GiB",
               "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["fits"] is True
    for key, kind in [("machine", str), ("host_budget", int), ("vram_budget", int), ("baseline", int),
                      ("target", dict), ("speculate", bool), ("draft_max", int), ("memory", dict),
                      ("tokens_per_s", float), ("speedup", float), ("reasons", list), ("suggestions", list),
                      ("speculative_tokens_per_s", float)]:
        assert isinstance(out[key], kind), key
    for key in ("path", "n_ctx", "n_batch", "type_k", "type_v", "flash_attn", "n_gpu_layers", "window"):
        assert key in out["target"]
    mem = out["memory"]
    assert mem["host_total_bytes"] == mem["baseline_bytes"] + mem["host_bytes"]
    assert sum(i["bytes"] for i in mem["items"] if i["device"] == "host") == mem["host_bytes"]
    assert {i["role"] for i in mem["items"]} <= {"target", "draft", "speculation", "runtime"}


def test_cli_refusal_exit_code_and_text(stories_twin: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "-m", str(stories_twin), "--ctx", "4096", "--budget", "20MiB"])
    out = capsys.readouterr().out
    assert rc == 6
    assert "fits:    NO" in out and "what would fit:" in out


CHAT = textwrap.dedent("""
    import json, sys, threading, time
    from tandem.runtime.hardware import process_rss
    from tandem.runtime.planner import plan_for_run
    from tandem.runtime.llama_backend import LlamaCppBackend
    from tandem.runtime.drafters.model import ModelDrafter
    from tandem.runtime.split import WindowedDrafter, split_speculative
    from tandem.runtime.chat import ChatEngine
    from tandem.kernels.sampling import SamplingParams
    from tandem.runtime.planner import SAFETY
    target_path, draft_path, squeeze, turns = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    # The tightest budgets, from this process's own baseline: the full pair's footprint,
    # or the target's plus only part of what speculation costs.
    full = plan_for_run(target_path, draft_path, "1GiB", 512, threads=1, acceptance=0.95)
    alone = plan_for_run(target_path, None, "1GiB", 512, threads=1)
    budget = int((alone.host_total + squeeze * (full.host_total - alone.host_total)) / (1 - SAFETY)) + 1
    plan = plan_for_run(target_path, draft_path, budget, 512, threads=1, acceptance=0.95)
    peak, stop = [0], threading.Event()
    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], process_rss()); time.sleep(0.002)
    threading.Thread(target=sample, daemon=True).start()
    target = LlamaCppBackend(plan.target.path, plan.target.llama_config())
    drafter = None
    if plan.draft is not None:
        drafter = ModelDrafter(LlamaCppBackend(plan.draft.path, plan.draft.llama_config()))
        if plan.draft.window:
            drafter = WindowedDrafter(drafter, plan.draft.window)
    strategy = split_speculative(drafter, plan.draft_max, predraft=False) if drafter else None
    engine = ChatEngine(target, strategy)
    messages = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Tell me story number {turn} about a cat and a dog."})
        reply = "".join(getattr(ev, "text", "") for ev in engine.stream(messages, SamplingParams(temperature=0), 48)
                        if type(ev).__name__ == "TokenEvent")
        messages.append({"role": "assistant", "content": reply})
    stop.set(); time.sleep(0.01)
    print(json.dumps({"peak": max(peak[0], process_rss()), "planned": plan.host_total, "budget": budget,
                      "full": full.host_total, "spec": plan.memory.speculation_extra(),
                      "full_spec": full.memory.speculation_extra(),
                      "window": plan.draft.window if plan.draft else None, "kept": plan.draft is not None,
                      "tokens": len(target.tokens)}))
""")


@pytest.mark.parametrize("squeeze", [1.0, 0.5])
def test_rss_stays_under_budget_during_a_long_chat(stories_twin: Path, stories260k: Path, squeeze: float) -> None:
    """``squeeze`` 1.0: the tightest budget the full pair fits; 0.5: half of what the
    drafter costs is taken away, so the planner must shrink or drop it."""
    proc = subprocess.run([sys.executable, "-c", CHAT, str(stories_twin), str(stories260k), str(squeeze), "8"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    budget = out["budget"]
    assert out["tokens"] > 400  # the chat really grew the context
    assert out["planned"] <= budget
    assert out["peak"] <= budget, f"RSS peaked at {out['peak']} over the budget {budget}"
    if squeeze < 1:
        assert out["spec"] < out["full_spec"]  # the drafter was shrunk or dropped


def test_drafter_goes_to_the_gpu_through_torch_when_llama_cpp_cannot_offload(
    stories_twin: Path, stories260k: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dovetail placement on a detected CUDA GPU with a CPU-only llama.cpp build."""
    from dataclasses import replace

    import llama_cpp
    import torch

    from tandem.runtime.hardware import GPU

    monkeypatch.setattr(llama_cpp, "llama_supports_gpu_offload", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    base = resolve_machine(None, "2GiB", None)
    gpu = GPU("test GPU", 8 * 1024**3, 8 * 1024**3, 300.0)
    machine = replace(base, gpus=(gpu,), vram_budget=4 * 1024**3, source="detected")
    plan = make_plan(PlanRequest(stories_twin, stories260k, 512, machine, acceptance=ALPHA, drop_slow_draft=False))
    assert plan.fits and plan.draft is not None
    assert plan.draft.device == "cuda" and plan.target.n_gpu_layers == 0
    assert any("torch engine" in r for r in plan.reasons)
    # Without a usable CUDA device the drafter stays with llama.cpp on the CPU.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu = make_plan(PlanRequest(stories_twin, stories260k, 512, machine, acceptance=ALPHA, drop_slow_draft=False))
    assert cpu.draft is not None and cpu.draft.device == "cpu"


def test_specmemo_budget_keeps_a_quantized_windowed_drafter(stories_twin: Path, stories260k: Path) -> None:
    """SpecMemo's bar: with the budget cut so speculation gets 35 % of its unconstrained
    extra memory, the planner still keeps a real drafter, as a Q8_0 copy with a short
    window and batch (BENCHMARKS.md measures its throughput), and plan_for_run makes the copy."""
    from tandem.runtime.planner import plan_for_run

    full = _plan(stories_twin, stories260k, "1GiB", ctx=2040)
    alone = _plan(stories_twin, None, "1GiB", ctx=2040)
    assert full.draft is not None and full.draft.quant is None  # roomy: the drafter's own weights
    extra = full.host_total - alone.host_total
    budget = int((alone.host_total + 0.35 * extra) / (1 - SAFETY))
    cut = _plan(stories_twin, stories260k, budget, ctx=2040)
    assert cut.fits and cut.draft is not None
    assert cut.draft.quant == "q8_0" and cut.draft.source == str(stories260k)
    # Windowed into llama.cpp's smallest cache (256 cells, window 251 at k = 4).
    assert cut.draft.window is not None and cut.draft.n_ctx <= 256
    assert cut.host_total - alone.host_total <= 0.35 * extra
    assert not Path(cut.draft.path).exists()  # make_plan only prices the copy
    # plan_for_run (this process's own baseline) makes the copy the plan names.
    alone_run = plan_for_run(stories_twin, None, "64GiB", 2040, threads=1)  # room for any process baseline
    squeezed = plan_for_run(stories_twin, stories260k, int((alone_run.host_total + 0.35 * extra) / (1 - SAFETY)),
                            2040, threads=1, acceptance=ALPHA)
    assert squeezed.draft is not None and squeezed.draft.quant == "q8_0"
    assert Path(squeezed.draft.path).is_file() and squeezed.draft.path != squeezed.draft.source


def _cuda_machine(monkeypatch: pytest.MonkeyPatch, budget: str, vram: int):
    """This machine with a simulated CUDA GPU, a CPU-only llama.cpp and torch seeing CUDA."""
    from dataclasses import replace

    import llama_cpp
    import torch

    from tandem.runtime.hardware import GPU

    monkeypatch.setattr(llama_cpp, "llama_supports_gpu_offload", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    base = resolve_machine(None, budget, None, measure_bandwidth=False)
    gpu = GPU("test GPU", 8 * 1024**3, 8 * 1024**3, 300.0)
    return replace(base, gpus=(gpu,), vram_budget=vram, source="detected")


def test_torch_gpu_drafter_is_priced_in_vram(stories_twin: Path, stories260k: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch drafter on CUDA: weights, KV and workspace in VRAM, the CUDA runtime's host
    side on the host; both devices fit, the GPU first; `tandem plan` lists its items on the gpu."""
    from tandem.app.cmd_plan import render
    from tandem.runtime.memory_model import TORCH_CUDA_HOST, Setup, shape_from_gguf, torch_gpu_items

    machine = _cuda_machine(monkeypatch, "2GiB", 4 * 1024**3)
    plan = make_plan(PlanRequest(stories_twin, stories260k, 512, machine, acceptance=ALPHA, drop_slow_draft=False,
                                 baseline=40 * MiB))
    assert plan.fits and plan.draft is not None
    assert plan.draft.device == "cuda" and plan.draft.devices == ("cuda", "cpu")
    draft_gpu = [i for i in plan.memory.items if i.role == "draft" and i.device == "gpu"]
    assert {"weights", "KV", "attention,"} <= {w for i in draft_gpu for w in i.label.split()}
    shape = shape_from_gguf(stories260k)
    priced = torch_gpu_items(shape, Setup(plan.draft.n_ctx, plan.draft.n_batch))
    assert plan.memory.total("gpu", "draft") > sum(i.bytes for i in priced if i.device == "gpu")  # + CUDA context
    assert 4 * shape.n_params <= plan.memory.total("gpu", "draft") <= plan.vram_budget
    from tandem.runtime.memory_model import TORCH_CUDA_HOST_CONTEXT
    from tandem.runtime.plan_devices import cuda_context_held

    host_side = TORCH_CUDA_HOST - (TORCH_CUDA_HOST_CONTEXT if cuda_context_held() else 0)  # a real GPU box may hold one
    assert any(i.device == "host" and i.bytes == host_side for i in plan.memory.items)
    assert plan.memory.total("host", "draft") < 4 * shape.n_params + TORCH_CUDA_HOST + 16 * MiB  # no host weights
    assert plan.draft.torch_config().n_ctx == plan.draft.n_ctx
    text = render(plan)
    assert any(line.split()[2:3] == ["gpu"] and "draft weights" in line for line in text.splitlines())


def test_vram_budget_bounds_the_torch_gpu_drafter(stories_twin: Path, stories260k: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Too little VRAM for the CUDA context: the drafter fits on the CPU only. Too little
    host for the llama.cpp drafter but room in VRAM (host side of CUDA made free here):
    it fits on the GPU only."""
    from dataclasses import replace

    from tandem.runtime import memory_model

    small = _cuda_machine(monkeypatch, "2GiB", 256 * MiB)
    plan = make_plan(PlanRequest(stories_twin, stories260k, 512, small, acceptance=ALPHA, drop_slow_draft=False,
                                 baseline=40 * MiB))
    assert plan.draft is not None and plan.draft.devices == ("cpu",) and plan.draft.device == "cpu"
    assert plan.memory.gpu == 0

    monkeypatch.setattr(memory_model, "TORCH_CUDA_HOST", 0)
    monkeypatch.setattr(memory_model, "TORCH", replace(memory_model.TORCH, per_model=0))
    alone = make_plan(PlanRequest(stories_twin, None, 512, small, baseline=40 * MiB))
    host_only = _cuda_machine(monkeypatch, str(int((alone.host_total + 200_000) / (1 - SAFETY))), 4 * 1024**3)
    plan = make_plan(PlanRequest(stories_twin, stories260k, 512, host_only, acceptance=ALPHA, drop_slow_draft=False,
                                 baseline=40 * MiB))
    assert plan.fits and plan.draft is not None
    assert plan.draft.devices == ("cuda",) and plan.draft.device == "cuda"
    assert plan.memory.gpu <= host_only.vram_budget
