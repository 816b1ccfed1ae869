"""Expert tensors of a MoE GGUF kept in host memory (llama.cpp's ``tensor_buft_overrides``)."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import llama_cpp
import numpy as np
import pytest
from tiny_moe import N_LAYER, write_tiny_moe

from tandem.errors import TandemError
from tandem.runtime.backends.host_experts import ALL_LAYERS, HostExperts, expert_layers, host_layers
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_config import LlamaConfig
from tandem.runtime.backends.llama_log import install as quiet_llama_log


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_moe(tmp_path_factory.mktemp("moe") / "tiny-moe.gguf")


@pytest.fixture(scope="module")
def tiny_dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_moe(tmp_path_factory.mktemp("dense") / "tiny-dense.gguf", n_expert=0)


@contextmanager
def llama_log() -> Iterator[list[str]]:
    """Everything llama.cpp logs (every level) while the block runs."""
    lines: list[str] = []

    @llama_cpp.llama_log_callback
    def hear(_level: int, text: bytes, _user: ctypes.c_void_p) -> None:
        lines.append(text.decode("utf-8", "replace"))

    llama_cpp.llama_log_set(hear, ctypes.c_void_p(0))
    try:
        yield lines
    finally:
        quiet_llama_log()


def greedy(backend: LlamaCppBackend, prompt: list[int], n: int) -> list[int]:
    logits = backend.evaluate(prompt)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits[-1])))
        logits = backend.evaluate([out[-1]])
    return out


def overridden(lines: list[str]) -> list[str]:
    """Tensor names llama.cpp says it put in an overriding buffer type."""
    return [line.split()[1] for line in "".join(lines).splitlines()
            if line.startswith("tensor ") and "buffer type overridden to CPU" in line]


def test_expert_layers_are_the_routed_experts_only() -> None:
    names = ["blk.0.ffn_gate_inp.weight", "blk.0.ffn_up_exps.weight", "blk.0.ffn_up_shexp.weight",
             "blk.2.ffn_down_exps.weight", "blk.10.ffn_gate_exps.weight", "blk.1.ffn_up.weight"]
    assert expert_layers(names) == (0, 2, 10)
    assert host_layers(2, (0, 2, 10)) == (0, 2)
    assert host_layers(ALL_LAYERS, (0, 2, 10)) == (0, 2, 10)
    found = HostExperts.for_model(1, names)
    assert found.tensors == ("blk.0.ffn_up_exps.weight",)
    with pytest.raises(TandemError, match="choose 0 to 3"):
        host_layers(4, (0, 2, 10))


def test_override_is_applied_to_the_expert_tensors_of_the_first_layers(tiny_moe: Path) -> None:
    with llama_log() as lines:
        b = LlamaCppBackend(tiny_moe, LlamaConfig(n_ctx=64, n_threads=1, host_expert_layers=2))
    try:
        assert sorted(overridden(lines)) == sorted(f"blk.{i}.ffn_{p}_exps.weight" for i in (0, 1)
                                                   for p in ("gate", "up", "down"))
        assert sorted(b.host_experts.tensors) == sorted(overridden(lines))
    finally:
        b.close()


def test_all_layers_and_greedy_output_unchanged(tiny_moe: Path) -> None:
    prompt = [1, 72, 101, 108, 108, 111]
    plain = LlamaCppBackend(tiny_moe, LlamaConfig(n_ctx=64, n_threads=1))
    try:
        want = greedy(plain, prompt, 16)
    finally:
        plain.close()
    with llama_log() as lines:
        hosted = LlamaCppBackend(tiny_moe, LlamaConfig(n_ctx=64, n_threads=1, host_expert_layers=ALL_LAYERS))
    try:
        assert len(overridden(lines)) == 3 * N_LAYER
        assert greedy(hosted, prompt, 16) == want
    finally:
        hosted.close()
    assert len(set(want)) > 1  # the check compares real output, not one repeated token


def test_dense_model_is_refused(tiny_dense: Path) -> None:
    with pytest.raises(TandemError, match="no expert tensors"):
        LlamaCppBackend(tiny_dense, LlamaConfig(n_ctx=64, n_threads=1, host_expert_layers=1))


def test_too_many_layers_is_refused(tiny_moe: Path) -> None:
    with pytest.raises(TandemError, match=f"experts in {N_LAYER} layers"):
        LlamaCppBackend(tiny_moe, LlamaConfig(n_ctx=64, n_threads=1, host_expert_layers=N_LAYER + 1))


def test_qwen3_moe_layout(tmp_path: Path) -> None:
    """Qwen3-MoE (the Qwen3-30B-A3B layout): the same overrides, the same greedy output."""
    model = write_tiny_moe(tmp_path / "tiny-qwen3moe.gguf", arch="qwen3moe")
    prompt = [1, 72, 101, 108, 108, 111]
    plain = LlamaCppBackend(model, LlamaConfig(n_ctx=64, n_threads=1))
    try:
        want = greedy(plain, prompt, 12)
    finally:
        plain.close()
    with llama_log() as lines:
        hosted = LlamaCppBackend(model, LlamaConfig(n_ctx=64, n_threads=1, host_expert_layers=1))
    try:
        assert sorted(overridden(lines)) == sorted(f"blk.0.ffn_{p}_exps.weight" for p in ("gate", "up", "down"))
        assert greedy(hosted, prompt, 12) == want
    finally:
        hosted.close()
