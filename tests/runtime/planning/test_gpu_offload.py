"""GPU offload in the planner: only a build that lists a local GPU offloads, and the bytes
put on the GPU follow llama.cpp's own rules (``llama_model::load_tensors``,
``llama_kv_cache``): which layers ``n_gpu_layers`` moves, the tied head's copy, the KV
cache of the offloaded layers at each cache type, and the device context."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tandem.runtime.backends import llama_devices
from tandem.runtime.backends.llama_devices import LlamaDevice
from tandem.runtime.planning.costs import LLAMA_CPP
from tandem.runtime.planning.hardware import GPU, MiB, resolve_machine
from tandem.runtime.planning.memory_model import Setup, estimate, gpu_layers, model_items
from tandem.runtime.planning.plan import PlanRequest
from tandem.runtime.planning.planner import make_plan
from tandem.runtime.planning.shapes import ModelShape, padded_ctx, shape_from_gguf

CPU = LlamaDevice("CPU", "host", "cpu", "CPU")
RPC_PEER = LlamaDevice("RPC0[10.0.0.2:50052]", "peer", "gpu", "RPC")
CUDA0 = LlamaDevice("CUDA0", "NVIDIA GeForce RTX 4070", "gpu", "CUDA", 11 * 1024**3, 12 * 1024**3)


def _machine_with_a_gpu(vram: int = 4 * 1024**3):
    """This machine as the planner sees it next to a detected NVIDIA card (what
    ``nvidia-smi``/torch would report), whatever this machine really has."""
    base = resolve_machine(None, "8GiB", None, measure_bandwidth=False)
    gpu = GPU("NVIDIA GeForce RTX 4070", 12 * 1024**3, 11 * 1024**3, 500.0)
    return replace(base, gpus=(gpu,), vram_budget=vram, source="detected")


def _plan(target: Path, machine):
    return make_plan(PlanRequest(target, None, 512, machine, baseline=40 * MiB, model_free=False))


def test_this_cpu_build_next_to_a_gpu_plans_no_gpu_layers(stories_twin: Path) -> None:
    """This machine's CPU build (with the RPC backend, so ``llama_supports_gpu_offload()``
    says yes) next to a detected GPU: no layers offloaded, no GPU memory priced."""
    if llama_devices.gpu_offload_build():
        pytest.skip("this llama.cpp build offloads to a GPU")
    plan = _plan(stories_twin, _machine_with_a_gpu())
    assert plan.fits and plan.target.n_gpu_layers == 0
    assert plan.memory.gpu == 0 and not any(i.device == "gpu" for i in plan.memory.items)
    assert any("no GPU offload in this llama.cpp build" in r for r in plan.reasons)


def test_an_rpc_only_build_next_to_a_gpu_does_not_offload(stories_twin: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A registry holding an RPC peer (which llama.cpp types as a GPU) and no local GPU."""
    monkeypatch.setattr(llama_devices, "list_devices", lambda memory=False: (CPU, RPC_PEER))
    plan = _plan(stories_twin, _machine_with_a_gpu())
    assert plan.target.n_gpu_layers == 0 and plan.memory.gpu == 0
    # The same machine with a build that lists the card offloads every layer.
    monkeypatch.setattr(llama_devices, "list_devices", lambda memory=False: (CPU, RPC_PEER, CUDA0))
    plan = _plan(stories_twin, _machine_with_a_gpu())
    assert plan.target.n_gpu_layers == -1
    assert 0 < plan.memory.gpu <= plan.vram_budget
    assert any(i.label == "GPU context" for i in plan.memory.items)
    assert any("all layers on the GPU" in r for r in plan.reasons)


def test_layers_on_the_gpu_run_flash_attention_and_the_cpu_stays_exact(stories_twin: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the exact configuration buys nothing (CUDA computes a verify batch
    differently from one-token steps anyway) and flash attention is llama.cpp's fast path
    there; on the CPU flash attention stays off (bit-identical speculative output)."""
    monkeypatch.setattr(llama_devices, "list_devices", lambda memory=False: (CPU, CUDA0))
    gpu = _plan(stories_twin, _machine_with_a_gpu())
    assert gpu.target.n_gpu_layers == -1 and gpu.target.llama_config().flash_attn
    assert gpu.target.setup().flash_attn  # priced as it will run
    assert any("flash attention on" in r for r in gpu.reasons)
    monkeypatch.setattr(llama_devices, "list_devices", lambda memory=False: (CPU,))
    cpu = _plan(stories_twin, _machine_with_a_gpu())
    assert cpu.target.n_gpu_layers == 0 and not cpu.target.llama_config().flash_attn


def test_a_small_vram_budget_offloads_part_and_never_exceeds_it(stories_twin: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llama_devices, "list_devices", lambda memory=False: (CPU, CUDA0))
    full = _plan(stories_twin, _machine_with_a_gpu())
    shape = shape_from_gguf(stories_twin)
    for share in (0.9, 0.7, 0.5):
        vram = int(full.memory.gpu * share)
        plan = _plan(stories_twin, _machine_with_a_gpu(vram))
        assert plan.fits and plan.memory.gpu <= vram
        assert 0 <= plan.target.n_gpu_layers <= shape.n_layer


def _shape(tied: bool = False, n_layer: int = 4) -> ModelShape:
    """A small decoder with distinct per-layer bytes, so which layers move is visible."""
    return ModelShape(n_vocab=1000, n_embd=64, n_ff=128, n_layer=n_layer, n_head=4, n_head_kv=2, head_dim=16,
                      n_ctx_train=4096, tied=tied, name="toy", layer_bytes=tuple(1000 * (i + 1) for i in range(n_layer)),
                      input_bytes=50_000, output_bytes=300 if tied else 60_000, weight_type="q4_k")


def _gpu(items, what: str) -> int:
    return sum(i.bytes for i in items if i.device == "gpu" and what in i.label)


@pytest.mark.parametrize(("ngl", "blocks", "head"), [(0, 0, False), (1, 0, True), (2, 1, True), (4, 3, True),
                                                     (5, 4, True), (99, 4, True), (-1, 4, True)])
def test_n_gpu_layers_counts_the_output_layer_first(ngl: int, blocks: int, head: bool) -> None:
    """``i_gpu_start = n_layer + 1 - n_gpu_layers``: 1 moves the head only, n_layer + 1 all."""
    assert gpu_layers(4, ngl) == (blocks, head)
    shape = _shape()
    items = model_items(shape, Setup(512, n_gpu_layers=ngl))
    moved = sum(shape.layer_bytes[4 - blocks:]) + (shape.output_bytes if head else 0)
    assert _gpu(items, "weights") == moved
    host = sum(i.bytes for i in items if i.device == "host" and "weights" in i.label)
    assert host == shape.weights_bytes - moved  # the embedding never leaves the host


def test_a_tied_head_is_copied_to_the_gpu() -> None:
    shape = _shape(tied=True)
    items = model_items(shape, Setup(512, n_gpu_layers=1))
    assert _gpu(items, "weights") == shape.output_bytes + shape.input_bytes
    host = sum(i.bytes for i in items if i.device == "host" and "weights" in i.label)
    assert host == shape.weights_bytes - shape.output_bytes  # the input layer keeps its own


@pytest.mark.parametrize("kv", ["f16", "q8_0", "q4_0"])
def test_kv_cache_of_the_offloaded_blocks_is_on_the_gpu(kv: str) -> None:
    """llama.cpp puts each layer's K and V on that layer's device (``offload_kqv``), over
    the padded cells, at the cache type's bytes per block (f16: 2 per value, q8_0: 34 per
    32, q4_0: 18 per 32)."""
    shape = _shape()
    per_value = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}[kv]
    cells = padded_ctx(1000)
    layer_kv = int(2 * shape.n_head_kv * shape.head_dim * per_value) * cells
    for ngl, blocks in ((0, 0), (1, 0), (3, 2), (-1, 4)):
        items = model_items(shape, Setup(1000, type_k=kv, type_v=kv, n_gpu_layers=ngl, flash_attn=kv != "f16"))
        assert _gpu(items, "KV") == blocks * layer_kv
        assert sum(i.bytes for i in items if "KV" in i.label) == shape.n_layer * layer_kv


def test_the_device_context_is_priced_once_with_anything_on_the_gpu() -> None:
    shape = _shape()
    cpu = estimate(shape, Setup(512), shape, Setup(512))
    gpu = estimate(shape, Setup(512, n_gpu_layers=-1), shape, Setup(512, n_gpu_layers=-1))
    assert cpu.gpu == 0
    contexts = [i for i in gpu.items if i.label == "GPU context"]
    assert len(contexts) == 1 and contexts[0].bytes == LLAMA_CPP.device_context


def test_without_torch_the_gpu_is_found_through_llama_cpp(monkeypatch: pytest.MonkeyPatch) -> None:
    """An install without torch and with a CUDA build: the card (and its free memory) is
    what llama.cpp's registry reports; an RPC peer is no card."""
    from tandem.runtime.planning import hardware

    monkeypatch.setenv("TANDEM_PROBE_CUDA", "1")
    monkeypatch.setattr(hardware, "_torch_gpus", lambda: ())
    monkeypatch.setattr(llama_devices, "list_devices", lambda memory=False: (CPU, RPC_PEER, CUDA0))
    (gpu,) = hardware.detect_gpus()
    assert (gpu.name, gpu.free_bytes, gpu.total_bytes) == ("NVIDIA GeForce RTX 4070", CUDA0.free_bytes,
                                                           CUDA0.total_bytes)
    monkeypatch.setattr(llama_devices, "list_devices", lambda memory=False: (CPU, RPC_PEER))
    assert hardware.detect_gpus() == ()


def test_a_cuda_build_of_llama_cpp_is_asked_before_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Torch's CUDA context (made by asking it for free memory) in a process that then
    loads a model on a CUDA build of llama.cpp crashes the load: where llama.cpp lists the
    card, torch is never asked; where it lists none, torch is."""
    from tandem.runtime.planning import hardware

    asked: list[str] = []

    def torch_gpus() -> tuple:
        asked.append("torch")
        return (hardware.GPU("torch's card", 8 << 30, 8 << 30, 500.0),)

    monkeypatch.setenv("TANDEM_PROBE_CUDA", "1")
    monkeypatch.setattr(hardware, "_torch_gpus", torch_gpus)
    monkeypatch.setattr(llama_devices, "list_devices", lambda memory=False: (CPU, CUDA0))
    (gpu,) = hardware.detect_gpus()
    assert gpu.name == "NVIDIA GeForce RTX 4070" and asked == []
    monkeypatch.setattr(llama_devices, "list_devices", lambda memory=False: (CPU,))
    (gpu,) = hardware.detect_gpus()
    assert gpu.name == "torch's card" and asked == ["torch"]


def test_tandem_plan_says_where_each_part_goes(stories_twin: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.app.commands.plan import render

    monkeypatch.setattr(llama_devices, "list_devices", lambda memory=False: (CPU, CUDA0))
    text = render(_plan(stories_twin, _machine_with_a_gpu()))
    where = next(line for line in text.splitlines() if line.startswith("where:"))
    assert "target " in where and " GPU + " in where and "runtime " in where  # weights/KV on the card, the rest here
    assert any(line.split()[2] == "gpu" and "GPU context" in line for line in text.splitlines() if line.startswith("  "))
    monkeypatch.setattr(llama_devices, "list_devices", lambda memory=False: (CPU, RPC_PEER))
    assert "where:" not in render(_plan(stories_twin, _machine_with_a_gpu()))


def test_the_gpu_compute_buffer_follows_what_runs_there() -> None:
    """The output layer alone on the GPU reserves the logits of a full batch there (what
    llama.cpp's scheduler gives that backend), not the blocks' attention buffers."""
    shape = _shape()
    head_only = _gpu(model_items(shape, Setup(512, n_batch=256, n_gpu_layers=1)), "compute")
    with_blocks = _gpu(model_items(shape, Setup(512, n_batch=256, n_gpu_layers=3)), "compute")
    assert head_only == 4 * 256 * shape.n_vocab
    assert with_blocks > head_only
