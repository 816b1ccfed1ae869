"""Quantized models for the GPU tier: the kit's real-shape models (random weights, same
files sizes and kernels as the real ones) under ``$KIT_MODELS`` on a GPU machine without
the real files, else the real models. Tests using them skip unless llama.cpp, as built
here, lists a GPU (:func:`tandem.runtime.backends.llama_devices.gpu_offload_build`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest


def offloading_build() -> bool:
    from tandem.runtime.backends.llama_devices import gpu_offload_build

    return gpu_offload_build()


needs_gpu_build = pytest.mark.skipif(not offloading_build(), reason="this llama.cpp build lists no GPU")


@dataclass(frozen=True)
class GpuModels:
    target: Path
    """Qwen2.5-Coder-1.5B-Instruct Q4_K_M (shape)."""
    drafter: Path
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M (shape): same vocabulary as the target."""
    chat: Path
    """SmolLM2-135M-Instruct Q4_1 (shape)."""
    random_weights: bool


def gpu_models(request: pytest.FixtureRequest) -> GpuModels:
    kit = os.environ.get("KIT_MODELS")
    if kit:
        folder = Path(kit)
        return GpuModels(folder / "qwen2.5-coder-1.5b.gguf", folder / "qwen2.5-coder-0.5b.gguf",
                         folder / "smollm2-135m-instruct.gguf", True)
    real = request.getfixturevalue("real_models")
    return GpuModels(Path(real.qwen_15b), Path(real.qwen_05b), Path(real.smollm2), False)
