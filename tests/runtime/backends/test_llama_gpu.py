"""Quantized GGUF models on the GPU through llama.cpp (the GPU tier: skipped unless the
llama.cpp build lists a GPU). Plain decoding, speculative decoding with model-free drafts
and with a model drafter, the chat app's engine, and what `tandem run` does, each with
every layer on the GPU.

Greedy identity on the GPU: a verify batch of k + 1 rows is not computed by the kernels a
one-token step uses (CUDA's quantized matrix-vector kernels take up to 8 columns, cuBLAS
picks its GEMM by shape for the attention products), so logits can differ in the last
bits. Greedy speculative output then equals plain greedy output, or the two part where
plain decoding's top two logits are closer than that difference (a near tie), which
:func:`check_greedy_identity` measures instead of assuming.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from gpu_models import GpuModels, gpu_models, needs_gpu_build
from greedy_runs import greedy_rows

from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_config import LlamaConfig
from tandem.runtime.backends.selfcheck import batch_step_difference
from tandem.runtime.generate import DoneEvent, generate
from tandem.runtime.speculative.factory import SpecOptions, build_strategy

pytestmark = needs_gpu_build
GPU = LlamaConfig(n_ctx=1024, n_gpu_layers=-1)
EDIT_PROMPT = ("<|im_start|>user\nRename the variable total to result in this code and return it:\n"
               "def add(values):\n    total = 0\n    for v in values:\n        total += v\n    return total\n"
               "<|im_end|>\n<|im_start|>assistant\n")
N_TOKENS = 48


@pytest.fixture(scope="module")
def models(request: pytest.FixtureRequest) -> GpuModels:
    return gpu_models(request)


@pytest.fixture(scope="module")
def target(models: GpuModels):
    backend = LlamaCppBackend(models.target, GPU)
    yield backend
    backend.close()


def _free_vram() -> int:
    from tandem.runtime.backends.llama_devices import gpu_devices

    return gpu_devices()[0].free_bytes


def test_the_weights_go_to_the_gpu_and_decode(models: GpuModels) -> None:
    from tandem.runtime.planning.shapes import shape_from_gguf

    before = _free_vram()
    with LlamaCppBackend(models.target, GPU) as b:
        taken = before - _free_vram()
        assert b.memory().device == "cuda"
        assert taken >= 0.9 * shape_from_gguf(models.target).weights_bytes, f"only {taken} bytes of VRAM taken"
        ids, rows = greedy_rows(b, b.tokenize(EDIT_PROMPT, special=True), 16)
        assert len(ids) == 16 and np.isfinite(rows).all()


def batch_noise(backend, ids: list[int], longest: int = 5) -> float:
    """Largest |logit| difference between a batch of 2..``longest`` rows (a verify of up
    to 4 drafts) and the same rows as one-token steps."""
    return max(batch_step_difference(backend, ids, m) for m in range(2, longest + 1))


def test_short_batches_on_the_gpu_compute_what_steps_compute(target) -> None:
    """What ``exact_batch`` (reported by `tandem run --json`) promises, checked on the GPU:
    up to that many rows in one call give bit-identical logits to one-token steps. If
    this fails, the GPU kernels break the promise and the backend must not make it for
    offloaded layers; the speculative tests below still bound the difference."""
    ids = target.tokenize(EDIT_PROMPT, special=True)
    diffs = {m: batch_step_difference(target, ids, m) for m in range(2, (target.exact_batch or 1) + 1)}
    print(f"batch-vs-steps logit differences on the GPU: {diffs}")
    assert all(d == 0.0 for d in diffs.values()), diffs


def _greedy(target, prompt: list[int], strategy=None) -> list[int]:
    target.truncate(0)
    kwargs = {} if strategy is None else {"strategy": strategy}
    events = list(generate(target, prompt, Sampler(SamplingParams.greedy_params()), max_tokens=N_TOKENS,
                           stop_at_eog=False, **kwargs))
    done = events[-1]
    assert isinstance(done, DoneEvent)
    return done.tokens


def check_greedy_identity(target, prompt: list[int], plain: list[int], spec: list[int]) -> None:
    """``spec == plain``, or they part at a near tie: plain's top two logits there are
    within twice the batch-vs-steps difference measured on this GPU."""
    if spec == plain:
        return
    at = next(i for i, (a, b) in enumerate(zip(plain, spec, strict=False)) if a != b)
    _, rows = greedy_rows(target, prompt, at)
    top2 = np.sort(rows[at])[-2:]
    margin = float(top2[1] - top2[0])
    noise = batch_noise(target, prompt + plain[:at])
    print(f"parted at token {at}: plain's margin {margin}, batch noise {noise}")
    assert margin <= 2 * noise, f"speculative output parted from plain at token {at} on a clear choice ({margin})"


@pytest.mark.parametrize("mode", ["ngram", "model"])
def test_greedy_speculative_on_the_gpu_is_plain_greedy(models: GpuModels, target, mode: str) -> None:
    prompt = target.tokenize(EDIT_PROMPT, special=True)
    plain = _greedy(target, prompt)
    draft = models.drafter if mode == "model" else None
    strategy = build_strategy(target, draft, SpecOptions(mode=mode, draft_length=4, measure_cost=False),
                              llama_config=GPU)
    try:
        spec = _greedy(target, prompt, strategy)
        if draft is not None:
            assert strategy.describe()  # the drafter opened (on the GPU: llama_config offloads every layer)
    finally:
        strategy.close()
    check_greedy_identity(target, prompt, plain, spec)


def test_the_chat_apps_engine_on_the_gpu(models: GpuModels) -> None:
    from tandem.runtime.chat import ChatEngine

    engine = ChatEngine(LlamaCppBackend(models.chat, LlamaConfig(n_ctx=512, n_gpu_layers=-1)))
    try:
        done = list(engine.stream([{"role": "user", "content": "Say hello."}], SamplingParams(temperature=0.0),
                                  max_tokens=24))[-1]
        assert done.stats.finish_reason in ("stop", "length")
        assert done.stats.generated_tokens > 0
    finally:
        engine.close()


@pytest.mark.parametrize("mode", ["off", "ngram", "model"])
def test_tandem_run_on_the_gpu(models: GpuModels, mode: str) -> None:
    """`tandem run` as a user runs it: the planner offloads every layer (the card has room),
    the run ends normally (no native crash), and the JSON says so."""
    cmd = [sys.executable, "-X", "faulthandler", "-m", "tandem.app.cli", "run", "-m", str(models.target),
           "-p", "def fib(n):", "-n", "32", "--raw", "--json", "--draft-mode", mode]
    if mode == "model":
        cmd += ["--draft", str(models.drafter)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert out["engine"]["n_gpu_layers"] == -1
    assert out["stats"]["generated_tokens"] > 0
