"""The memory model against llama.cpp's own numbers and against measured resident memory.

Measurements run in fresh subprocesses (:mod:`tandem.runtime.planning.memprobe`): peak RSS growth
from just before loading to after a prefill that fills the context, a verification-like
call and a few decode steps (what is counted is documented there).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.models.gguf_file import inspect_gguf
from tandem.models.shape import KV_TYPE_SIZES
from tandem.runtime.planning.memory_model import Setup, estimate, model_items
from tandem.runtime.planning.memprobe import ProbeModel, ProbeSpec, measure
from tandem.runtime.planning.shapes import shape_from_gguf, shape_from_hf

TOLERANCE = 0.10
LLAMA_UNDER = 0.03
"""A llama.cpp estimate may be under the measured peak by at most 3 % (the promise's side)..."""
LLAMA_SLACK = 1_500_000
"""...plus 1.5 MB: at fixture scale (5-70 MB) the first-decode allocations of a process
(thread start-up, allocator arenas) are a few percent on their own."""
LLAMA_OVER = 0.35
"""Over by at most 35 % on the fixtures: the matmul work buffer is priced at its upper
bound (attention scores converted to f16 for every head), which the 8M twin's 32 heads
of 8 values make as large as its weights; on real models (12-14 heads of 64-128) the
same bound costs 1-3 % (the real-model test holds them to +10 %)."""


def _check_llama(predicted: int, measured: int, what: str) -> None:
    error = predicted / measured - 1
    print(f"{what}: predicted {predicted} vs measured {measured} ({error:+.1%})")
    assert predicted >= measured * (1 - LLAMA_UNDER) - LLAMA_SLACK, f"under: {predicted} vs {measured} ({error:+.1%})"
    assert predicted <= measured * (1 + LLAMA_OVER), f"over: {predicted} vs {measured} ({error:+.1%})"


def test_shape_accounts_for_every_tensor(stories_twin: Path) -> None:
    info = inspect_gguf(stories_twin)
    shape = shape_from_gguf(info)
    assert shape.weights_bytes == info.weights_bytes
    assert len(shape.layer_bytes) == shape.n_layer
    assert shape.n_vocab == 512


def test_gpu_offload_moves_bytes_without_losing_any(stories_twin: Path) -> None:
    shape = shape_from_gguf(stories_twin)
    cpu = estimate(shape, Setup(1024), include_process=False)
    part = estimate(shape, Setup(1024, n_gpu_layers=2), include_process=False)
    full = estimate(shape, Setup(1024, n_gpu_layers=-1), include_process=False)

    def weights_kv(e, device=None):
        return sum(i.bytes for i in e.items if ("weights" in i.label or "KV" in i.label)
                   and (device is None or i.device == device))

    # A tied head is loaded twice: the input layer keeps the embedding on the CPU and the
    # output layer gets its own copy on the GPU; nothing else is lost or counted twice.
    copy = shape.input_bytes if shape.tied else 0
    assert weights_kv(cpu) == weights_kv(part) - copy == weights_kv(full) - copy
    assert 0 < weights_kv(part, "gpu") < weights_kv(full, "gpu")
    # llama.cpp's n_gpu_layers counts the output layer first, then blocks from the top:
    # 2 layers are the head and the last block. The embedding never moves.
    assert weights_kv(full, "host") >= shape.input_bytes
    assert weights_kv(part, "gpu") == (shape.layer_bytes[-1] + shape.output_bytes + copy
                                       + shape.kv_bytes_per_token() * 1024 // shape.n_layer)


def test_kv_quantization_and_context_scale_the_cache(stories_twin: Path) -> None:
    from dataclasses import replace

    # Arithmetic only: without a path the shape is not sized by llama.cpp (which refuses a
    # q8_0 cache for this model's 8-wide heads; the planner checks kv_type_ok first).
    shape = replace(shape_from_gguf(stories_twin), path=None)

    def kv(setup):
        return sum(i.bytes for i in model_items(shape, setup) if "KV" in i.label)

    assert kv(Setup(2048)) == 2 * kv(Setup(1024))
    block, size = KV_TYPE_SIZES["q8_0"]
    assert kv(Setup(1024, type_k="q8_0", type_v="q8_0")) == kv(Setup(1024)) * size // (2 * block)


def test_torch_shape_from_hf_config(tinystories656k_dir: Path) -> None:
    from safetensors import safe_open

    shape = shape_from_hf(tinystories656k_dir)
    with safe_open(str(tinystories656k_dir / "model.safetensors"), "numpy") as f:
        stored = sum(f.get_slice(k).get_shape()[0] * (f.get_slice(k).get_shape()[1:] or [1])[0] for k in f.keys())  # noqa: SIM118 (safetensors handle, not a dict)
    # Tied embeddings: the file stores the matrix once, the shape prices it once.
    assert shape.n_params == stored
    assert shape.weights_bytes == 4 * stored


def _check(spec: ProbeSpec, predicted: int) -> None:
    _check_llama(predicted, measure(spec)["peak_bytes"], "memory model")


@pytest.mark.parametrize(("ctx", "batch"), [(256, 256), (1024, 256), (2048, 64), (2304, 256), (2304, 512), (4096, 256)])
def test_predicted_peak_matches_measured_fixture(stories260k: Path, ctx: int, batch: int) -> None:
    """(2304, 256) is SpecMemo's unconstrained drafter (2040-token context + k + 2,
    padded): the old flash-attention compute term over-predicted it by 14 %, and
    4096 × 256 by 30 %."""
    shape = shape_from_gguf(stories260k)
    setup = Setup(ctx, batch, output_rows=5)
    spec = ProbeSpec([ProbeModel(str(stories260k), ctx, batch, prompt_tokens=ctx - 16, output_rows=5)])
    _check(spec, estimate(shape, setup).host)


@pytest.mark.parametrize(("ctx", "draft_ctx", "k", "kv"), [(512, 512, 4, "f16"), (1024, 256, 8, "f16"), (256, 1024, 2, "f32")])
def test_predicted_peak_matches_measured_twin_pair(stories_twin: Path, stories260k: Path, ctx: int,
                                                   draft_ctx: int, k: int, kv: str) -> None:
    t_shape, d_shape = shape_from_gguf(stories_twin), shape_from_gguf(stories260k)
    t_setup = Setup(ctx + k, 256, kv, kv, output_rows=k + 1)
    d_setup = Setup(draft_ctx + k + 1, 64)
    spec = ProbeSpec([
        ProbeModel(str(stories_twin), ctx + k, 256, type_k=kv, type_v=kv, prompt_tokens=ctx - 16, output_rows=k + 1),
        ProbeModel(str(stories260k), draft_ctx + k + 1, 64, prompt_tokens=draft_ctx - 16),
    ])
    predicted = estimate(t_shape, t_setup, d_shape, d_setup, k=k)
    # The probe holds no drafter q rows (Python-side speculation buffers): leave them out.
    _check(spec, predicted.host - predicted.total(role="speculation"))


@pytest.fixture(scope="module")
def target_alone_peak(stories_twin: Path) -> tuple[ProbeModel, int]:
    """The 8M twin as a verifying target (k = 4) and its peak alone in a fresh process."""
    target = ProbeModel(str(stories_twin), 516, 256, prompt_tokens=64, output_rows=5)
    return target, measure(ProbeSpec([target]))["peak_bytes"]


@pytest.mark.parametrize(("drafter", "window", "batch"), [
    ("f32", 128, 8), ("f32", 128, 64), ("f32", 256, 8), ("f32", 256, 64), ("f32", 1024, 8), ("f32", 1024, 64),
    ("f32", 1024, 256), ("f32", 2040, 256),
    ("q8_0", 128, 8), ("q8_0", 256, 64), ("q8_0", 1024, 8), ("q8_0", 1024, 256), ("q8_0", 2040, 256),
    ("656k", 128, 8), ("656k", 256, 64), ("656k", 1024, 256),
])
def test_drafter_extra_next_to_a_target_matches_measured(request: pytest.FixtureRequest, stories260k: Path,
                                                         target_alone_peak: tuple[ProbeModel, int],
                                                         drafter: str, window: int, batch: int) -> None:
    """What a drafter context adds to a process that already runs its target, against
    the drafter's items in the pair's estimate (priced as the second llama.cpp model in
    the process, ``per_model_next``): stories260K F32, its Q8_0 copy and tinystories-656k
    F32, windows 128-2040 (2040 × 256 is SpecMemo's unconstrained drafter, 128 × 8 its
    lean one). The drafter refills its window (window + k + 1 cells), as in
    ``bench_memory``. Batches at or above the window are left out: such a drafter
    refills in one ubatch, while the model prices a context longer than a batch as
    filled in two (up to 1 MB over at 256 × 256)."""
    from tandem.models.quantize import cached_copy

    path = {"f32": stories260k, "q8_0": cached_copy(stories260k, "q8_0"),
            "656k": request.getfixturevalue("tinystories656k_gguf")}[drafter]
    target, alone = target_alone_peak
    k, n_ctx = 4, window + 5
    both = measure(ProbeSpec([target, ProbeModel(str(path), n_ctx, batch, prompt_tokens=n_ctx - k - 2)]))["peak_bytes"]
    est = estimate(shape_from_gguf(target.path), Setup(target.n_ctx, 256, output_rows=5), shape_from_gguf(path),
                   Setup(n_ctx, batch), k=k)
    _check_llama(est.total(role="draft"), both - alone, f"drafter {drafter} window {window} batch {batch}")


def test_quantized_copy_is_priced_before_it_exists(stories260k: Path, tmp_path: Path) -> None:
    """The planner prices a drafter's Q8_0 copy from the header alone; llama.cpp's quantizer
    then makes exactly that many bytes of weights (including its f16 fallback for rows
    that do not hold whole blocks)."""
    from tandem.models.quantize import cached_copy, cached_copy_path

    predicted = shape_from_gguf(stories260k, as_type="q8_0")
    made = cached_copy(stories260k, "q8_0")
    assert made == cached_copy_path(stories260k, "q8_0") and made.is_file()
    assert cached_copy(stories260k, "q8_0") == made  # cached: made once
    actual = shape_from_gguf(made)
    assert predicted.weights_bytes == actual.weights_bytes
    assert predicted.layer_bytes == actual.layer_bytes
    assert predicted.weights_bytes < 0.35 * shape_from_gguf(stories260k).weights_bytes


ONNX_SLACK = 512 * 1024
"""Absolute slack for the onnxruntime check at its smallest point (a few MB in all)."""


def error_to_nearest_run(predicted: int, runs: list[int]) -> tuple[float, int]:
    """The prediction's relative error against the identical fresh run it is closest to.

    Identical runs of the small engines differ by up to ~13 % (which heap blocks glibc or
    the arena keep), more than the tolerance itself: a prediction is as good as the
    nearest peak a real run reached, not as good as one draw of the noise. Nearest in the
    unit the bound is stated in (relative to the run): 50.6 and 61.7 MB around a 55.9 MB
    prediction are +10.4 % and -9.4 %, so the second is the nearer one."""
    nearest = min(runs, key=lambda run: abs(predicted / run - 1))
    return predicted / nearest - 1, nearest


@pytest.fixture(scope="module")
def stories_onnx(stories260k: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tandem.runtime.backends.onnx_export import export_onnx

    out = tmp_path_factory.mktemp("onnx-memory")
    export_onnx(stories260k, out)
    return out


@pytest.mark.parametrize(("ctx", "batch"), [(256, 256), (1024, 256), (1024, 64)])
def test_predicted_peak_matches_measured_onnx(stories260k: Path, stories_onnx: Path, ctx: int, batch: int) -> None:
    """The onnxruntime (CPU) estimate against a fresh process's peak: weights (the fp32
    graph), six copies of the KV, the arena's score-sized buffers. At 1024 × 256 the
    process holds ~50 MB, so the 10 % bound bites there."""
    shape = shape_from_gguf(stories260k)
    predicted = estimate(shape, Setup(ctx, batch, type_k="f32", type_v="f32", output_rows=5), kind="onnxruntime").host
    spec = ProbeSpec([ProbeModel(str(stories_onnx), ctx, batch, prompt_tokens=ctx - 16, output_rows=5,
                                 kind="onnxruntime")])
    runs = sorted(measure(spec)["peak_bytes"] for _ in range(3))
    error, nearest = error_to_nearest_run(predicted, runs)
    print(f"onnxruntime ({ctx}, {batch}): predicted {predicted} vs measured {runs} ({error:+.1%})")
    assert abs(predicted - nearest) <= max(TOLERANCE * nearest, ONNX_SLACK), f"{error:+.1%}"


def test_cuda_context_in_the_baseline_is_not_counted_twice(stories_twin: Path, stories260k: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Planning on a detected GPU has created the CUDA context, whose host share is then
    in the measured baseline: the torch drafter's host side drops by that share."""
    import sys
    import types

    from tandem.runtime.planning import devices as plan_devices
    from tandem.runtime.planning.costs import TORCH_CUDA_HOST, TORCH_CUDA_HOST_CONTEXT

    t, d = shape_from_gguf(stories_twin), shape_from_gguf(stories260k)
    fresh = estimate(t, Setup(512), d, Setup(512), k=4, draft_device="cuda")
    held = estimate(t, Setup(512), d, Setup(512), k=4, draft_device="cuda", cuda_context_held=True)
    assert fresh.host - held.host == TORCH_CUDA_HOST_CONTEXT
    assert fresh.gpu == held.gpu
    assert any(i.bytes == TORCH_CUDA_HOST - TORCH_CUDA_HOST_CONTEXT for i in held.items)

    for initialized in (False, True):
        fake = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda v=initialized: v))
        monkeypatch.setitem(sys.modules, "torch", fake)
        assert plan_devices.cuda_context_held() is initialized
    monkeypatch.delitem(sys.modules, "torch")
    assert plan_devices.cuda_context_held() is False


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


GPU_SLACK = 256 * 1024
"""Absolute slack for the VRAM check: the CUDA caching allocator's rounding and a few
small temporaries (rope tables, index tensors) are not itemised; on drafters of 1-3 MB
of weights that is a few percent, so a 10 % bound alone would test the allocator."""


@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU visible to torch (torch.cuda.is_available() is False)")
@pytest.mark.parametrize(("n_batch", "chunks"), [(64, 2), (256, 2), (512, 4)])
def test_torch_gpu_drafter_vram_matches_prediction(tinystories656k_gguf: Path, n_batch: int, chunks: int) -> None:
    """A drafter in the torch engine on CUDA: peak ``torch.cuda.max_memory_allocated`` over a
    workload that reaches the chunk the planner prices as the worst (``n_batch`` tokens
    seeing nearly the whole context), then a verification-like call and decode steps,
    against the planner's VRAM items (weights, KV, workspace).

    A 5-token turn comes first so the chunks end at unaligned lengths, as in real use:
    for key counts that are multiples of 16 SDPA may pick a leaner kernel, and the plan
    must hold for any length. The CUDA context and cuBLAS workspace are per-process
    costs outside this comparison (cuBLAS is warmed up before the baseline is read)."""
    import torch

    from tandem.runtime.backends.torch_engine.backend import TorchBackend, TorchConfig
    from tandem.runtime.planning.memory_model import torch_gpu_items

    n_ctx = 5 + chunks * n_batch + 9
    shape = shape_from_gguf(tinystories656k_gguf)
    predicted = sum(i.bytes for i in torch_gpu_items(shape, Setup(n_ctx, n_batch, output_rows=5)) if i.device == "gpu")
    warm = torch.ones(8, 8, device="cuda")
    (warm @ warm).sum().item()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    backend = TorchBackend(tinystories656k_gguf, TorchConfig(device="cuda", n_ctx=n_ctx, n_batch=n_batch))
    try:
        backend.evaluate([1, 9, 17, 33, 65])
        backend.evaluate([(i * 7) % (backend.n_vocab - 3) + 3 for i in range(chunks * n_batch)])
        backend.evaluate([5] * 5, logits_for=list(range(5)))
        for _ in range(4):
            backend.evaluate([5])
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated() - base
    finally:
        backend.close()
    error = predicted / measured - 1
    print(f"torch GPU drafter (n_ctx {n_ctx}, batch {n_batch}): predicted {predicted} vs measured {measured} "
          f"({error:+.1%})")
    assert abs(predicted - measured) <= max(TOLERANCE * measured, GPU_SLACK), (
        f"predicted {predicted} vs measured {measured} ({error:+.1%})")


TORCH_SLACK = 2_000_000
"""Absolute slack for the torch (CPU) check at its smallest point (~16 MB in all), where
glibc's heap retention moves a run by ~1 MB. Below that (stories260K at 256 x 256, ~11 MB)
identical runs measure 11 or 15 MB — which blocks the heap keeps — so no bound is tested."""
TORCH_OVER = 0.15
"""Over the nearest run by at most 15 % (the safe side; under it stays at
:data:`TOLERANCE`). At stories260K 2048 x 256 identical runs peak at 50.6-50.8 MB or at
61.7 MB, as glibc keeps an 11 MB block or not, and the prediction (55.9 MB) sits between
the two: CI once drew three low runs, +10.1 % over all of them."""


@pytest.mark.parametrize(("model", "ctx", "batch"), [("260K", 1024, 256), ("260K", 2048, 256), ("656k", 256, 256),
                                                     ("656k", 512, 512)])
def test_predicted_peak_matches_measured_torch(request: pytest.FixtureRequest, model: str, ctx: int,
                                               batch: int) -> None:
    """The torch engine on the CPU against a fresh process's peak: float32 weights, the
    doubling KV cache and the heap glibc keeps after it, SDPA's math-path score matrices
    and masks for the worst chunk, activations and the tokenizer tables."""
    path = request.getfixturevalue("stories260k" if model == "260K" else "tinystories656k_gguf")
    shape = shape_from_gguf(path)
    predicted = estimate(shape, Setup(ctx, batch, type_k="f32", type_v="f32", output_rows=5), kind="torch").host
    spec = ProbeSpec([ProbeModel(str(path), ctx, batch, kind="torch", prompt_tokens=ctx - 16, output_rows=5)])
    runs = sorted(measure(spec)["peak_bytes"] for _ in range(3))
    error, nearest = error_to_nearest_run(predicted, runs)
    print(f"torch {model} ({ctx}, {batch}): predicted {predicted} vs measured {runs} ({error:+.1%})")
    bound = TORCH_OVER if predicted > nearest else TOLERANCE
    assert abs(predicted - nearest) <= max(bound * nearest, TORCH_SLACK), f"{error:+.1%}"


# -- the promise on real models: `tandem plan` against `tandem run`'s peak resident memory ----------
REAL_UNDER = 0.03
"""The prediction may be under the measured peak by at most 3 % (the promise's side)..."""
REAL_OVER = 0.10
"""...and over it by at most 10 %."""


def _code_prompt(n_words: int) -> str:
    """A code-like prompt of about ``18 * n_words`` tokens (Qwen's and SmolLM2's tokenizers)."""
    return "".join(f"def f{i}(x):\n    return x * {i} + {i}\n" for i in range(n_words))


_WAIT4 = """
import json, os, subprocess, sys
proc = subprocess.Popen(sys.argv[2:], stdin=sys.stdin, stdout=sys.stdout, stderr=sys.stderr)
_, status, usage = os.wait4(proc.pid, 0)
proc.returncode = 0
with open(sys.argv[1], "w") as fh:
    json.dump([os.waitstatus_to_exitcode(status), usage.ru_maxrss], fh)
"""
"""Runs a command and reports its exit code and ``ru_maxrss``. It runs in a small fresh
interpreter because Linux starts a spawned child's ``ru_maxrss`` at the spawning
process's own peak (the mm it leaves at exec): spawned straight from a test process
that has grown to 2 GB, every child would report 2 GB."""


def cli_peak_rss(args: list[str], stdin: str = "", timeout: float = 600) -> tuple[int, str, str]:
    """Run ``tandem ARGS`` in a fresh process; (peak resident bytes as ``/usr/bin/time
    -f %M`` reports it — the child's own ``ru_maxrss`` from ``wait4`` —, stdout, stderr)."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err, \
            tempfile.TemporaryFile("w+") as inp, tempfile.TemporaryDirectory() as folder:
        inp.write(stdin)
        inp.seek(0)
        report = os.path.join(folder, "report.json")
        cmd = [sys.executable, "-c", _WAIT4, report, sys.executable, "-m", "tandem.app.cli", *args]
        subprocess.run(cmd, stdin=inp, stdout=out, stderr=err, timeout=timeout, check=False)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
        with open(report) as fh:
            code, maxrss_kb = json.load(fh)
    assert code == 0, stderr[-2000:]
    return maxrss_kb * 1024, stdout, stderr


def _plan_json(args: list[str]) -> dict:
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "tandem.app.cli", "plan", *args, "--json"], capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize(("target", "draft", "ctx", "words", "flags"), [
    ("smollm2", None, 2048, 85, ()),
    ("qwen_05b", None, 512, 21, ()),
    ("qwen_15b", None, 512, 21, ()),
    ("qwen_15b", None, 512, 21, ("--repack",)),
    # A fixed draft length drafts every round, so the drafter is loaded: with the adaptive
    # length it is opened only when first asked for a draft, and may never be.
    ("qwen_15b", "qwen_05b", 512, 21, ("--draft-len", "3")),
])
def test_real_model_peak_rss_matches_plan_and_stays_under_budget(real_models, target: str, draft: str | None,
                                                                  ctx: int, words: int, flags: tuple[str, ...]) -> None:
    """`tandem plan --json` predicts the peak resident memory of `tandem run` with the
    same settings (a prompt filling most of the context, a few decode tokens) within
    -3 %/+10 %, and that run, given the tightest budget the plan fits, stays under it.
    Both are fresh processes, as a user runs them. ``--repack`` is planned as the same
    bytes: its weights are read, not mapped, so no page of the file stays resident
    beside the repacked copies."""
    from tandem.runtime.planning.devices import SAFETY

    models = ["-m", str(getattr(real_models, target)), "--ctx", str(ctx)]
    if draft:
        models += ["--draft", str(getattr(real_models, draft))]
    roomy = _plan_json([*models, "--budget", "64GiB"])
    budget = int(roomy["memory"]["host_total_bytes"] / (1 - SAFETY)) + 1024**2
    plan = _plan_json([*models, "--budget", str(budget)])
    assert plan["fits"] and plan["memory"]["host_total_bytes"] == roomy["memory"]["host_total_bytes"]
    predicted = plan["memory"]["host_total_bytes"]
    measured, _, err = cli_peak_rss(["run", *models, *flags, "--budget", str(budget), "--raw", "-n", "4",
                                     "--threads", "2"], stdin=_code_prompt(words))
    error = predicted / measured - 1
    print(f"{target}+{draft} {flags} ctx {ctx}: predicted {predicted} measured {measured} ({error:+.1%}); {err.strip()[-200:]}")
    assert -REAL_UNDER <= error <= REAL_OVER, f"predicted {predicted} vs measured {measured} ({error:+.1%})"
    assert measured <= budget


def test_gguf_run_does_not_import_torch(stories260k: Path) -> None:
    """A GGUF-only `tandem run` (and its plan) never imports torch: hundreds of MB of
    resident memory the budget would pay for nothing."""
    import subprocess
    import sys

    code = ("import sys\nfrom tandem.app.cli import main\n"
            f"rc = main(['run', '-m', {str(stories260k)!r}, '-p', 'Once', '-n', '2', '--ctx', '256'])\n"
            "print('torch' in sys.modules, rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "False 0"


def test_the_context_overhead_is_measured_alike_each_time() -> None:
    """The machine baseline's llama.cpp context overhead, measured twice in one fresh
    process: the second context is built where the first one's memory was freed, and both
    see the same growth. Before, freed heap pages were reused unseen (the second figure
    was 0), and the figure cached for the machine was 0 about one first run in six, which
    made every later estimate about 1 MB short."""
    import subprocess
    import sys

    code = ("import llama_cpp; llama_cpp.llama_backend_init(); "
            "from tandem.runtime.planning.baseline import _llama_context_overhead as measure; "
            "print(measure(), measure())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    first, second = map(int, out.stdout.split()[-2:])
    assert first > 0 and second > 0 and 0.5 < second / first < 2, (first, second)
