"""Drafter and target on different devices keep greedy output identical (needs CUDA).

The Dovetail placement: the drafter on the GPU (torch engine), the target on CPU
threads (llama.cpp), with and without pre-drafting; and the reverse placement.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_config import LlamaConfig
from tandem.runtime.backends.torch_engine.backend import TorchBackend, TorchConfig
from tandem.runtime.generate import DoneEvent, autoregressive, generate
from tandem.runtime.speculative.drafters.model import ModelDrafter
from tandem.runtime.speculative.overlap import split_speculative

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
PROMPTS = ["Once upon a time", "The little dog", "Lily and Ben went to the park. They"]


def tokens_of(target, prompt: list[int], strategy) -> list[int]:
    target.truncate(0)
    events = generate(target, prompt, Sampler(SamplingParams.greedy_params()), strategy=strategy,
                      max_tokens=64, stop_at_eog=False)
    return [e for e in events if isinstance(e, DoneEvent)][0].tokens


@pytest.mark.parametrize("predraft", [False, True])
def test_drafter_on_gpu_target_on_cpu(stories260k: Path, predraft: bool) -> None:
    target = LlamaCppBackend(stories260k, LlamaConfig(n_ctx=512, n_threads=2))
    drafter = ModelDrafter(TorchBackend(stories260k, TorchConfig(device="cuda", n_ctx=512)))
    assert drafter.backend.memory().device.startswith("cuda")
    try:
        for text in PROMPTS:
            prompt = target.tokenize(text, add_bos=True)
            assert tokens_of(target, prompt, split_speculative(drafter, 4, predraft=predraft)) == \
                tokens_of(target, prompt, autoregressive)
    finally:
        target.close()
        drafter.close()


def test_target_on_gpu_drafter_on_cpu(stories260k: Path) -> None:
    target = TorchBackend(stories260k, TorchConfig(device="cuda", n_ctx=512))
    drafter = ModelDrafter(LlamaCppBackend(stories260k, LlamaConfig(n_ctx=512, n_threads=2)))
    try:
        for text in PROMPTS:
            prompt = target.tokenize(text, add_bos=True)
            assert tokens_of(target, prompt, split_speculative(drafter, 4)) == tokens_of(target, prompt, autoregressive)
    finally:
        target.close()
        drafter.close()


@pytest.mark.parametrize("device", ["auto", "gpu", "target-gpu"])
def test_placement_through_the_planner_is_lossless(stories_twin: Path, stories260k: Path, device: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """What `tandem run` does: plan, measure the options (incl. the target on the GPU),
    place, generate: the output is the placed target's own greedy output. llama.cpp is
    taken as a CPU build (a CUDA build offloads the drafter itself: tests/gpu covers it)."""
    from tandem.runtime.backends import llama_devices

    monkeypatch.setattr(llama_devices, "gpu_offload_build", lambda: False)
    from tandem.runtime.planning.calibration import place
    from tandem.runtime.planning.planner import plan_for_run
    from tandem.runtime.speculative.factory import SpecOptions, build_strategy

    plan = plan_for_run(stories_twin, stories260k, ctx=512, threads=2, drop_slow_draft=False)
    assert "cuda" in plan.draft.devices
    target = LlamaCppBackend(stories_twin, plan.target.llama_config())
    placed = place(target, plan, mode="model", device=device, notify=lambda _: None)
    target = placed.target
    try:
        if device == "target-gpu":
            assert isinstance(target, TorchBackend) and target.memory().device.startswith("cuda")
        if device == "auto":
            assert placed.choice is not None and len(placed.choice.predicted) >= 4
        strategy = build_strategy(target, placed.draft_path, SpecOptions(
            mode="model", draft_length=4, draft_device=placed.draft_device, predraft=placed.predraft),
            llama_config=placed.llama_config, torch_config=placed.torch_config)
        try:
            for text in PROMPTS:
                prompt = target.tokenize(text, add_bos=True)
                assert tokens_of(target, prompt, strategy) == tokens_of(target, prompt, autoregressive)
        finally:
            strategy.close()
    finally:
        target.close()
