"""``--moe-offload`` on a MoE GGUF: the planner keeps the experts of as few blocks as it
takes in host memory for everything else to fit ``--vram``, and never plans past it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from tiny_moe import N_LAYER, write_tiny_moe

from tandem.errors import TandemError
from tandem.runtime.backends import llama_devices
from tandem.runtime.backends.llama_devices import LlamaDevice
from tandem.runtime.planning.devices import SAFETY
from tandem.runtime.planning.hardware import GPU, MiB, resolve_machine
from tandem.runtime.planning.memory_model import Setup, estimate
from tandem.runtime.planning.plan import PlanRequest
from tandem.runtime.planning.planner import make_plan
from tandem.runtime.planning.shapes import shape_from_gguf

CPU = LlamaDevice("CPU", "host", "cpu", "CPU")
CUDA0 = LlamaDevice("CUDA0", "NVIDIA GeForce RTX 4070", "gpu", "CUDA", 11 * 1024**3, 12 * 1024**3)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_moe(tmp_path_factory.mktemp("moe") / "tiny-moe.gguf")


@pytest.fixture
def cuda_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """A llama.cpp build that lists a local CUDA card (this machine's has none)."""
    monkeypatch.setattr(llama_devices, "list_devices", lambda memory=False: (CPU, CUDA0))


def _machine(vram: int):
    base = resolve_machine(None, "8GiB", None, measure_bandwidth=False)
    gpu = GPU("NVIDIA GeForce RTX 4070", 12 * 1024**3, 11 * 1024**3, 500.0)
    return replace(base, gpus=(gpu,), vram_budget=vram, source="detected")


def _plan(target: Path, vram: int, moe: bool = True):
    return make_plan(PlanRequest(target, None, 128, _machine(vram), baseline=40 * MiB, model_free=False,
                                 moe_offload=moe))


def test_shape_prices_expert_bytes_per_layer(tiny_moe: Path) -> None:
    shape = shape_from_gguf(tiny_moe)
    assert shape.expert_layers == tuple(range(N_LAYER))
    per_layer = shape.expert_bytes[0]
    assert per_layer == 3 * 4 * 64 * 128 * 4  # gate, up, down of 4 f32 experts of 64x128
    assert all(e < b for e, b in zip(shape.expert_bytes, shape.layer_bytes, strict=True))
    assert shape.host_expert_bytes(2) == 2 * per_layer and shape.host_expert_bytes(-1) == N_LAYER * per_layer
    # every GPU byte kept home is a host byte
    full = estimate(shape, Setup(128, n_gpu_layers=-1))
    home = estimate(shape, Setup(128, n_gpu_layers=-1, host_expert_layers=2))
    assert full.gpu - home.gpu == 2 * per_layer
    assert home.host - full.host == 2 * per_layer


def test_fewest_layers_whose_experts_stay_home_under_several_budgets(tiny_moe: Path, cuda_build: None) -> None:
    shape = shape_from_gguf(tiny_moe)
    gpu_at = [estimate(shape, Setup(128 + 8, n_gpu_layers=-1, output_rows=9, host_expert_layers=n)).gpu
              for n in range(N_LAYER + 1)]
    assert gpu_at == sorted(gpu_at, reverse=True)
    chosen = []
    for n in range(N_LAYER + 1):
        vram = int(gpu_at[n] / (1 - SAFETY)) + 1024  # just enough for n layers' experts at home
        plan = _plan(tiny_moe, vram)
        assert plan.fits and plan.target.n_gpu_layers == -1
        assert plan.memory.gpu <= vram * (1 - SAFETY)
        chosen.append(plan.target.host_expert_layers)
        assert plan.target.llama_config().host_expert_layers == chosen[-1]
    assert chosen == list(range(N_LAYER + 1))
    assert any(f"experts of 2/{N_LAYER} layers in host memory" in r for r in _plan(
        tiny_moe, int(gpu_at[2] / (1 - SAFETY)) + 1024).reasons)


def test_too_small_a_budget_keeps_all_experts_home_and_offloads_fewer_layers(tiny_moe: Path,
                                                                               cuda_build: None) -> None:
    shape = shape_from_gguf(tiny_moe)
    two = estimate(shape, Setup(136, n_gpu_layers=2, output_rows=9, host_expert_layers=N_LAYER)).gpu
    vram = int(two / (1 - SAFETY)) + 1024  # the output layer and one block, all experts at home
    plan = _plan(tiny_moe, vram)
    assert plan.fits and plan.target.host_expert_layers == N_LAYER and plan.target.n_gpu_layers == 2
    assert plan.memory.gpu <= vram * (1 - SAFETY)
    # no room for even the GPU context: nothing offloaded, so nothing to keep home either
    plan = _plan(tiny_moe, 64 * MiB)
    assert plan.fits and plan.target.n_gpu_layers == 0 and plan.target.host_expert_layers == 0
    assert plan.memory.gpu == 0


def test_without_the_flag_the_experts_are_not_kept_home(tiny_moe: Path, cuda_build: None) -> None:
    assert _plan(tiny_moe, 4 * 1024**3, moe=False).target.host_expert_layers == 0


def test_a_dense_gguf_is_refused(tmp_path: Path, cuda_build: None) -> None:
    dense = write_tiny_moe(tmp_path / "dense.gguf", n_expert=0)
    with pytest.raises(TandemError, match="not a mixture-of-experts GGUF"):
        _plan(dense, 4 * 1024**3)


def test_a_drafter_on_the_gpu_leaves_the_target_less_room(tiny_moe: Path, tmp_path: Path, cuda_build: None) -> None:
    """With a drafter named, its GPU share comes first: more of the target's experts stay home."""
    draft = write_tiny_moe(tmp_path / "draft.gguf", seed=1, n_expert=0)
    shape = shape_from_gguf(tiny_moe)
    vram = int(estimate(shape, Setup(136, n_gpu_layers=-1, output_rows=9, host_expert_layers=0)).gpu
               / (1 - SAFETY)) + 1024  # the target alone fits with every expert on the GPU
    alone = _plan(tiny_moe, vram)
    assert alone.target.host_expert_layers == 0
    both = make_plan(PlanRequest(tiny_moe, draft, 128, _machine(vram), baseline=40 * MiB, model_free=False,
                                 drop_slow_draft=False, moe_offload=True))
    assert both.fits and both.draft is not None and both.memory.gpu <= vram * (1 - SAFETY)
    assert both.draft.n_gpu_layers != 0 and both.target.n_gpu_layers != 0
    assert both.target.host_expert_layers > alone.target.host_expert_layers
