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
from tandem.errors import BudgetError
from tandem.runtime.planning.devices import SAFETY
from tandem.runtime.planning.hardware import MiB, resolve_machine
from tandem.runtime.planning.plan import PlanRequest
from tandem.runtime.planning.planner import make_plan

ALPHA = 0.95
"""stories260K drafting for its own twin accepts (nearly) every token: measured in test_split."""


def _plan(target: Path, draft: Path | None, budget, ctx: int | None = 512, **kw):
    """Plan on this machine's CPU and RAM (a GPU this machine may have is set aside, so the
    figures are the same on every test machine) or on a named profile (``profile=``)."""
    from dataclasses import replace

    machine = resolve_machine(budget=budget, measure_bandwidth=False, **kw)
    if machine.source == "detected":
        machine = replace(machine, gpus=(), vram_budget=0)
    # Model-free drafting's index is left out (model_free=False): these tests are about the
    # ladder of drafter settings, which does not change it (test_model_free_index_is_priced).
    return make_plan(PlanRequest(target, draft, ctx, machine, acceptance=ALPHA, baseline=40 * MiB, model_free=False))


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


def _lean_budget(target: Path, ctx: int, share: float) -> int:
    """A budget holding ``share`` of the leanest rung at ``ctx`` (baseline 40 MiB, as ``_plan``)."""
    from tandem.runtime.planning.shapes import shape_from_gguf
    from tandem.runtime.planning.suggest import lean_need, leanest_kv

    shape = shape_from_gguf(target)
    return int((40 * MiB + share * lean_need(shape, ctx, leanest_kv(shape, True), 8)) / (1 - SAFETY))


def test_impossible_budget_is_refused_with_suggestions_that_agree(stories_twin: Path, stories260k: Path) -> None:
    """Below the leanest rung nothing fits; the suggestions are each true and do not
    contradict each other: the largest context fits this budget (and is smaller than the
    one asked for), the suggested budget fits the context asked for."""
    budget = _lean_budget(stories_twin, 2048, 0.9)
    plan = _plan(stories_twin, stories260k, budget, ctx=2048)
    assert not plan.fits
    assert any(s.startswith("--ctx ") for s in plan.suggestions)
    assert any(s.startswith("--budget ") for s in plan.suggestions)
    with pytest.raises(BudgetError, match="What would fit"):
        plan.check()
    ctx = int(next(s for s in plan.suggestions if s.startswith("--ctx ")).split()[1])
    assert ctx < 2048
    again = _plan(stories_twin, None, budget, ctx=ctx)
    assert again.fits and again.target.n_ctx >= ctx
    assert not _plan(stories_twin, None, budget, ctx=ctx + 256).fits
    size = next(s for s in plan.suggestions if s.startswith("--budget ")).split()[1:3]
    roomy = _plan(stories_twin, None, "".join(size), ctx=2048)
    assert roomy.fits and roomy.target.n_ctx >= 2048
    assert roomy.host_budget > budget


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
    rc = main(["plan", "-m", str(stories_twin), "--ctx", "2048", "--budget", "20MiB"])
    out = capsys.readouterr().out
    assert rc == 6
    assert "fits:    NO" in out and "what would fit:" in out
    rc = main(["plan", "-m", str(stories_twin), "--ctx", "2048", "--budget", "20MiB", "--json"])
    assert rc == 6 and json.loads(capsys.readouterr().out)["fits"] is False


@pytest.mark.parametrize("command", ["plan", "run"])
def test_context_longer_than_training_is_refused(stories260k: Path, command: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """stories260K was trained on 2048 tokens: --ctx 4096 is refused before anything
    loads, with the limit named; 2048 itself is fine."""
    extra = ["-p", "Once", "-n", "2"] if command == "run" else []
    rc = main([command, "-m", str(stories260k), "--ctx", "4096", *extra])
    err = capsys.readouterr().err
    assert rc != 0
    assert "trained for (2048 tokens)" in err and "--ctx 2048 or less" in err
    assert main([command, "-m", str(stories260k), "--ctx", "2048", *extra]) == 0


def test_breakdown_rows_add_up_to_the_total(stories_twin: Path, stories260k: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Every byte of the printed total is in a row (the process baseline included) and no
    row is empty, in the text and in the JSON."""
    args = ["plan", "-m", str(stories_twin), "--draft", str(stories260k), "--ctx", "1024", "--budget", "32GiB"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    mem = out["memory"]
    assert all(i["bytes"] > 0 for i in mem["items"])
    assert mem["baseline_bytes"] + sum(i["bytes"] for i in mem["items"] if i["device"] == "host") == mem["host_total_bytes"]
    assert main(args) == 0
    text = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(text) if line.startswith("memory:"))
    total = float(text[start].split()[1])
    rows = []
    for line in text[start + 1:]:
        if not line.startswith("  "):
            break
        rows.append(line)
    assert any("process baseline" in r for r in rows)
    assert abs(sum(float(r.split()[0]) for r in rows) - total) <= 0.0005 * (len(rows) + 1)
    assert not any(float(r.split()[0]) == 0 for r in rows)


def test_model_free_index_is_priced(stories_twin: Path, stories260k: Path) -> None:
    """With a draft model, model-free drafting runs too (``--draft-mode auto``): its
    index over the context is a row of the plan, at this machine's measured cost per token."""
    from tandem.runtime.planning.baseline import machine_baseline

    machine = resolve_machine(budget="4GiB", measure_bandwidth=False)
    with_draft = make_plan(PlanRequest(stories_twin, stories260k, 1024, machine, baseline=40 * MiB))
    rows = [i for i in with_draft.memory.items if i.label.startswith("model-free drafting index")]
    assert len(rows) == 1
    assert rows[0].bytes == int(machine_baseline().draft_index_per_token * (1024 + with_draft.draft_max)) > 0
    alone = make_plan(PlanRequest(stories_twin, None, 1024, machine, baseline=40 * MiB))
    assert not any(i.label.startswith("model-free") for i in alone.memory.items)


def test_predicted_speed_is_stable_between_identical_calls(stories_twin: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The bandwidth behind the predicted speed is measured once per machine and cached."""
    speeds = []
    for _ in range(3):
        assert main(["plan", "-m", str(stories_twin), "--ctx", "512", "--json"]) == 0
        speeds.append(json.loads(capsys.readouterr().out)["tokens_per_s"])
    assert speeds[0] > 0 and len(set(speeds)) == 1


CHAT = textwrap.dedent("""
    import json, sys, threading, time
    from tandem.runtime.planning.memprobe import process_rss
    from tandem.runtime.planning.planner import plan_for_run
    from tandem.runtime.backends.llama import LlamaCppBackend
    from tandem.runtime.speculative.drafters.model import ModelDrafter
    from tandem.runtime.speculative.overlap import WindowedDrafter, split_speculative
    from tandem.runtime.chat import ChatEngine
    from tandem.kernels.sampling_params import SamplingParams
    from tandem.runtime.planning.devices import SAFETY
    target_path, draft_path, squeeze, turns = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    roomy, threads, reply_tokens = sys.argv[5], int(sys.argv[6]), int(sys.argv[7])
    # The tightest budgets, from this process's own baseline: the full pair's footprint,
    # or the target's plus only part of what speculation costs.
    full = plan_for_run(target_path, draft_path, roomy, 512, threads=threads, acceptance=0.95)
    alone = plan_for_run(target_path, None, roomy, 512, threads=threads)
    budget = int((alone.host_total + squeeze * (full.host_total - alone.host_total)) / (1 - SAFETY)) + 1
    plan = plan_for_run(target_path, draft_path, budget, 512, threads=threads, acceptance=0.95)
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
        reply = "".join(getattr(ev, "text", "") for ev in engine.stream(messages, SamplingParams(temperature=0), reply_tokens)
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
    proc = subprocess.run([sys.executable, "-c", CHAT, str(stories_twin), str(stories260k), str(squeeze), "8",
                           "1GiB", "1", "48"], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    budget = out["budget"]
    assert out["tokens"] > 400  # the chat really grew the context
    assert out["planned"] <= budget
    assert out["peak"] <= budget, f"RSS peaked at {out['peak']} over the budget {budget}"
    if squeeze < 1:
        assert out["spec"] < out["full_spec"]  # the drafter was shrunk or dropped


def test_rss_stays_under_budget_during_a_real_chat(real_models) -> None:
    """The promise on the real pair: Qwen2.5-Coder 1.5B with its 0.5B drafter, at the
    tightest budget the plan fits, through a multi-turn chat (chat template, speculative
    decoding), resident memory sampled all along."""
    proc = subprocess.run([sys.executable, "-c", CHAT, str(real_models.qwen_15b), str(real_models.qwen_05b), "1.0",
                           "3", "64GiB", "2", "24"], capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(out)
    assert out["kept"] and out["tokens"] > 100
    assert out["planned"] <= out["budget"]
    assert out["peak"] <= out["budget"], f"RSS peaked at {out['peak']} over the budget {out['budget']}"


def test_drafter_goes_to_the_gpu_through_torch_when_llama_cpp_cannot_offload(
    stories_twin: Path, stories260k: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dovetail placement on a detected CUDA GPU with a CPU-only llama.cpp build."""
    from dataclasses import replace

    import torch

    from tandem.runtime.backends import llama_devices
    from tandem.runtime.planning.hardware import GPU

    monkeypatch.setattr(llama_devices, "gpu_offload_build", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    base = resolve_machine(None, "6GiB", None)  # room for the torch CUDA host side whatever the baseline
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
    extra memory, the planner still keeps a real drafter (windowed, or a Q8_0 copy).
    Cut further, the ladder reaches the Q8_0 copy with a short window before it drops
    the drafter, and plan_for_run makes the copy the plan names."""
    from tandem.runtime.planning.planner import plan_for_run

    full = _plan(stories_twin, stories260k, "1GiB", ctx=2040)
    alone = _plan(stories_twin, None, "1GiB", ctx=2040)
    assert full.draft is not None and full.draft.quant is None  # roomy: the drafter's own weights
    extra = full.host_total - alone.host_total

    def cut(share: float):
        return _plan(stories_twin, stories260k, int((alone.host_total + share * extra) / (1 - SAFETY)), ctx=2040)

    bar = cut(0.35)
    assert bar.fits and bar.draft is not None
    assert bar.draft.window is not None or bar.draft.quant == "q8_0"
    assert bar.host_total - alone.host_total <= 0.35 * extra
    share = None
    for x in (0.35 - 0.01 * i for i in range(35)):  # down in 1 % steps until the drafter is dropped
        plan = cut(x)
        if plan.draft is None:
            break
        if plan.draft.quant == "q8_0":
            share = x  # the leanest share that still kept the Q8_0 copy, so far
    # (1 % steps: the last Q8_0 rung spans only ~4 % of the extra memory at this scale,
    # and where it starts moves with the sizes llama.cpp reports on each machine)
    assert share is not None, "the ladder dropped the drafter before trying its Q8_0 copy"
    quantized = cut(share)
    assert quantized.draft is not None and quantized.draft.source == str(stories260k)
    assert quantized.draft.window is not None and quantized.draft.n_ctx <= 256  # llama.cpp's smallest cache
    assert not Path(quantized.draft.path).exists()  # make_plan only prices the copy
    # plan_for_run (this process's own baseline) makes the copy the plan names.
    alone_run = plan_for_run(stories_twin, None, "64GiB", 2040, threads=1)  # room for any process baseline
    squeezed = plan_for_run(stories_twin, stories260k, int((alone_run.host_total + share * extra) / (1 - SAFETY)),
                            2040, threads=1, acceptance=ALPHA, model_free=False)
    assert squeezed.draft is not None and squeezed.draft.quant == "q8_0"
    assert Path(squeezed.draft.path).is_file() and squeezed.draft.path != squeezed.draft.source


def _cuda_machine(monkeypatch: pytest.MonkeyPatch, budget: str, vram: int):
    """This machine with a simulated CUDA GPU, a CPU-only llama.cpp and torch seeing CUDA."""
    from dataclasses import replace

    import torch

    from tandem.runtime.backends import llama_devices
    from tandem.runtime.planning.hardware import GPU

    monkeypatch.setattr(llama_devices, "gpu_offload_build", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    base = resolve_machine(None, budget, None, measure_bandwidth=False)
    gpu = GPU("test GPU", 8 * 1024**3, 8 * 1024**3, 300.0)
    return replace(base, gpus=(gpu,), vram_budget=vram, source="detected")


def test_torch_gpu_drafter_is_priced_in_vram(stories_twin: Path, stories260k: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch drafter on CUDA: weights, KV and workspace in VRAM, the CUDA runtime's host
    side on the host; both devices fit, the GPU first; `tandem plan` lists its items on the gpu."""
    from tandem.app.commands.plan import render
    from tandem.runtime.planning.costs import TORCH_CUDA_HOST
    from tandem.runtime.planning.memory_model import Setup, torch_gpu_items
    from tandem.runtime.planning.shapes import shape_from_gguf

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
    from tandem.runtime.planning.costs import TORCH_CUDA_HOST_CONTEXT
    from tandem.runtime.planning.devices import cuda_context_held

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

    from tandem.runtime.planning import memory_model
    from tandem.runtime.planning.shapes import shape_from_gguf

    small = _cuda_machine(monkeypatch, "2GiB", 256 * MiB)
    plan = make_plan(PlanRequest(stories_twin, stories260k, 512, small, acceptance=ALPHA, drop_slow_draft=False,
                                 baseline=40 * MiB))
    assert plan.draft is not None and plan.draft.devices == ("cpu",) and plan.draft.device == "cpu"
    assert plan.memory.gpu == 0

    monkeypatch.setattr(memory_model, "TORCH_CUDA_HOST", 0)
    monkeypatch.setattr(memory_model, "TORCH", replace(memory_model.TORCH, per_model=0))
    from tandem.runtime.planning.suggest import lean_need, leanest_kv

    # Room for the target's leanest rung and 200 kB: no llama.cpp drafter fits beside it.
    shape = shape_from_gguf(stories_twin)
    lean = lean_need(shape, 512, leanest_kv(shape, True), 8)
    host_only = _cuda_machine(monkeypatch, str(int((40 * MiB + lean + 200_000) / (1 - SAFETY))), 4 * 1024**3)
    plan = make_plan(PlanRequest(stories_twin, stories260k, 512, host_only, acceptance=ALPHA, drop_slow_draft=False,
                                 baseline=40 * MiB, model_free=False))
    assert plan.fits and plan.draft is not None
    assert plan.draft.devices == ("cuda",) and plan.draft.device == "cuda"
    assert plan.memory.gpu <= host_only.vram_budget
