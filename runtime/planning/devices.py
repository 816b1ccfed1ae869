"""Which devices a plan's models go on, and whether an estimate fits the budgets.

Split out of :mod:`tandem.runtime.planning.planner`, which walks its ladder of settings and asks
here, rung by rung, where target and drafter fit:

* a llama.cpp build that offloads (CUDA/Metal, or any profile with a GPU) gives the
  small drafter GPU layers first and the target the rest (Dovetail);
* otherwise the drafter is priced on the CPU (llama.cpp, host memory) and, on a detected
  CUDA GPU with torch, in the torch engine there: VRAM for float32 weights, KV cache,
  workspace and the CUDA context, plus the CUDA runtime's host side
  (:func:`tandem.runtime.planning.memory_model.torch_gpu_items`); ``ModelPlan.devices`` lists
  every device it fits on, the GPU first, and a measured calibration picks between them.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import TYPE_CHECKING

from tandem.runtime.backends import llama_devices
from tandem.runtime.planning.hardware import Machine
from tandem.runtime.planning.memory_model import Estimate, Setup, estimate
from tandem.runtime.planning.shapes import ModelShape

if TYPE_CHECKING:
    from tandem.runtime.planning.plan import ModelPlan

SAFETY = 0.03
"""Share of the budget kept free for what the model does not see (allocator slack)."""


def torch_cuda_ok(machine: Machine) -> bool:
    """Whether a drafter could run on a detected CUDA GPU through the torch engine (whether
    it fits is priced per rung, in VRAM)."""
    gpu = machine.gpu
    if gpu is None or gpu.kind != "cuda" or machine.source != "detected" or machine.vram_budget <= 0:
        return False
    import torch  # local: a detected CUDA GPU was found through torch, so it is installed

    return bool(torch.cuda.is_available())


def cuda_context_held() -> bool:
    """Whether this process already holds a CUDA context (``torch.cuda.is_initialized()``).

    Planning on a detected GPU asks CUDA for free VRAM, which creates the context, and
    the host baseline is read from this process's RSS: the context's host share is then
    already in the baseline and must not be priced again. False when torch was never
    imported (it cannot have created a context)."""

    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def gpu_offload_ok(machine: Machine) -> bool:
    """Whether llama.cpp can offload layers here, or in the profile.

    On this machine that takes a GPU in the plan *and* a llama.cpp build that lists a
    local GPU device (:func:`tandem.runtime.backends.llama_devices.gpu_offload_build`):
    ``llama_supports_gpu_offload()`` is also true for a CPU build with the RPC backend,
    and a plan trusting it would set ``n_gpu_layers`` and price GPU memory llama.cpp
    never allocates. A ``--vram`` on a machine without a GPU plans a hypothetical one,
    which this build cannot offload to either."""
    if not machine.gpus or machine.vram_budget <= 0:
        return False
    if machine.source != "detected":
        return True

    return llama_devices.gpu_offload_build()


def rooms(machine: Machine, baseline: int) -> tuple[float, float]:
    """Bytes a plan may use in host memory (the budget less the safety share and the
    ``baseline`` already resident) and on the GPU (its budget; less the safety share
    unless the memory is unified, where the host room already keeps it)."""
    gpu = machine.gpu
    unified = gpu is not None and gpu.unified
    return (machine.host_budget * (1 - SAFETY) - baseline,
            machine.vram_budget if unified else machine.vram_budget * (1 - SAFETY))


def fits(est: Estimate, machine: Machine, baseline: int) -> bool:
    host_room, gpu_room = rooms(machine, baseline)
    gpu = machine.gpu
    if gpu is not None and gpu.unified:  # one memory: the GPU share counts against the host's too
        return est.host + est.gpu <= host_room and est.gpu <= gpu_room
    return est.host <= host_room and est.gpu <= gpu_room


def max_gpu_layers(shape: ModelShape, setup: Setup, machine: Machine, baseline: int, others: Estimate) -> int:
    """Most llama.cpp ``n_gpu_layers`` whose GPU share fits next to ``others``; -1 = all."""
    if not gpu_offload_ok(machine):
        return 0
    for g in [-1, *range(shape.n_layer, 0, -1)]:
        est = estimate(shape, replace(setup, n_gpu_layers=g))
        both = Estimate(est.items + others.items)
        if fits(both, machine, baseline):
            return g
    return 0


def place_experts(shape: ModelShape, setup: Setup, machine: Machine, baseline: int, others: Estimate,
                  ) -> tuple[int, int]:
    """(``n_gpu_layers``, ``host_expert_layers``) for a MoE GGUF under ``--moe-offload``: every
    layer on the GPU with the experts of as few blocks as it takes in host memory; when
    even all of them there leave too little room, all experts stay home and the most
    layers that then fit go to the GPU. ``(0, 0)`` when no layer goes to the GPU (the
    experts are in host memory anyway), without offload or without experts."""
    experts = shape.expert_layers
    if not gpu_offload_ok(machine) or not experts:
        return 0, 0
    for n in range(len(experts) + 1):
        est = estimate(shape, replace(setup, n_gpu_layers=-1, host_expert_layers=n))
        if fits(Estimate(est.items + others.items), machine, baseline):
            return -1, n
    g = max_gpu_layers(shape, replace(setup, host_expert_layers=len(experts)), machine, baseline, others)
    return (g, len(experts)) if g else (0, 0)


def place_on_gpu(machine: Machine, baseline: int, t_shape: ModelShape, target: ModelPlan, k: int,
                 d_shape: ModelShape, draft: ModelPlan, experts_home: bool = False, target_on_gpu: bool = True,
                 ) -> tuple[ModelPlan, ModelPlan, Estimate]:
    """(target, drafter, estimate) with a llama.cpp build that offloads, fitting or not: the
    small drafter takes GPU layers first and the target the rest (none with
    ``target_on_gpu=False``: the target on CPU threads, the GPU the drafter's alone).
    ``experts_home`` (``--moe-offload``): the target's experts stay home as
    :func:`place_experts` chooses."""
    t_setup = target.setup(k + 1)
    g = max_gpu_layers(d_shape, draft.setup(), machine, baseline, Estimate())
    draft = replace(draft, n_gpu_layers=g)
    d_est = estimate(d_shape, draft.setup(), include_process=False)
    if experts_home and t_shape.expert_bytes:
        g, n_home = place_experts(t_shape, t_setup, machine, baseline, d_est)
        target = replace(target, n_gpu_layers=g, host_expert_layers=n_home)
    elif target_on_gpu:
        target = replace(target, n_gpu_layers=max_gpu_layers(t_shape, t_setup, machine, baseline, d_est))
    else:
        target = replace(target, n_gpu_layers=0)
    return target, draft, estimate(t_shape, target.setup(k + 1), d_shape, draft.setup(), k=k)


def place_draft(machine: Machine, baseline: int, gpu_ok: bool, torch_cuda: bool, t_shape: ModelShape,
                target: ModelPlan, k: int, d_shape: ModelShape, draft: ModelPlan, experts_home: bool = False,
                ) -> tuple[ModelPlan, ModelPlan, Estimate] | None:
    """(target, drafter, estimate) with the drafter on every device it fits on, or None.

    A llama.cpp build that offloads gives the small drafter GPU layers first and the
    target the rest (:func:`place_on_gpu`). Otherwise the drafter is priced on the CPU
    (llama.cpp, host memory) and, with a usable CUDA GPU, in the torch engine there (VRAM,
    plus the CUDA runtime's host side); ``devices`` lists those that fit, the GPU first."""
    if gpu_ok:
        target, draft, est = place_on_gpu(machine, baseline, t_shape, target, k, d_shape, draft, experts_home)
        return (target, draft, est) if fits(est, machine, baseline) else None
    t_setup = target.setup(k + 1)
    options = {"cpu": estimate(t_shape, t_setup, d_shape, draft.setup(), k=k)}
    if torch_cuda:
        options["cuda"] = estimate(t_shape, t_setup, d_shape, draft.setup(), k=k, draft_device="cuda",
                                   cuda_context_held=machine.source == "detected" and cuda_context_held())
    devices = tuple(d for d in ("cuda", "cpu") if d in options and fits(options[d], machine, baseline))
    if not devices:
        return None
    return target, replace(draft, device=devices[0], devices=devices), options[devices[0]]
