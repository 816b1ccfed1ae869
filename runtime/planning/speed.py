"""How fast a plan decodes, predicted before anything loads: the planner's cost model.

A decode step reads, once, every weight it multiplies with and (on average over a
reply) half the KV cache, on whichever device holds them: on each device it costs
``bytes / (bandwidth x DECODE_EFFICIENCY)``. A block on a GPU also pays a fixed launch
cost (:data:`GPU_LAYER_S`): small models on a fast card are launch-bound, not
bandwidth-bound. The token embedding is resident but only one row of it is read per
token, so it costs nothing here; a tied output head reads it whole.

Verifying ``k`` drafts costs ``c(k)`` one-token steps, and ``c`` depends on the device:
:data:`~tandem.runtime.speculative.cost.CPU_COST_CURVE` on CPU threads,
:data:`GPU_COST_CURVE` on a GPU. A target split between the two (llama.cpp partial
offload) pays each device's share of its step at that device's ``c(k)``. The speedup of
a drafter whose step costs ``c_draft`` target steps is then the round model of
:func:`predicted_speedup`; the adaptive policy picks the length at run time, so a plan
is worth its best length up to ``k``.

These are predictions for comparing placements on the same machine; `tandem bench
--gpu` measures them.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.kernels.acceptance import expected_tokens
from tandem.runtime.planning.hardware import Machine
from tandem.runtime.planning.memory_model import Setup, experts_kept_home, gpu_layers
from tandem.runtime.planning.shapes import ModelShape, padded_ctx
from tandem.runtime.speculative.cost import CPU_COST_CURVE, CostCurve

DECODE_EFFICIENCY = 0.6
"""Share of memory bandwidth a decode step achieves reading weights (llama.cpp)."""
GPU_LAYER_S = 50e-6
"""Seconds a decode step spends per block on a GPU beyond reading its bytes: kernel
launches and synchronisation. Fitted to llama.cpp CUDA one-token steps on an H200
(Qwen2.5-Coder-0.5B shapes 1.36 ms for 24 blocks, 1.5B 2.02 ms for 28: both far above
what their bytes take at 4.8 TB/s)."""
GPU_COST_CURVE = CostCurve((1.0, 1.07, 1.2, 1.3, 1.4, 1.5, 1.62, 1.75, 1.85), 0.0)
"""c(k) on a GPU: a (k+1)-token call over a one-token call, between what llama.cpp CUDA
measured for the Qwen2.5 1.5B and 7B shapes on an H200 (c(4 tokens) 1.27-1.41, c(8
tokens) 1.79-1.89)."""


@dataclass(frozen=True)
class StepCost:
    """Predicted seconds of one decode step, by device."""

    host_s: float
    gpu_s: float = 0.0

    @property
    def seconds(self) -> float:
        return self.host_s + self.gpu_s

    def verify(self, k: int) -> float:
        """c(k) of this step: each device's share at that device's curve."""
        total = self.seconds
        if total <= 0:
            return CPU_COST_CURVE(k)
        return (self.host_s * CPU_COST_CURVE(k) + self.gpu_s * GPU_COST_CURVE(k)) / total


def read_bytes(shape: ModelShape, setup: Setup) -> tuple[int, int, int]:
    """(host bytes, GPU bytes, GPU blocks) one decode step reads: the weights of each
    block and of the output head where llama.cpp puts them, and half of each block's
    KV cache (the average fill over a reply)."""
    g, head_on_gpu = gpu_layers(shape.n_layer, setup.n_gpu_layers)
    head = shape.output_bytes + (shape.input_bytes if shape.tied else 0)
    kv_layer = shape.kv_bytes_per_token(setup.type_k, setup.type_v) * padded_ctx(setup.n_ctx) // max(shape.n_layer, 1)
    home = experts_kept_home(shape, g, setup.host_expert_layers)
    gpu_blocks = sum(shape.layer_bytes[shape.n_layer - g:]) - home
    host_blocks = sum(shape.layer_bytes) - gpu_blocks
    host = host_blocks + (0 if head_on_gpu else head) + kv_layer * (shape.n_layer - g) // 2
    gpu = gpu_blocks + (head if head_on_gpu else 0) + kv_layer * g // 2
    return host, gpu, g + int(head_on_gpu)


def step_cost(shape: ModelShape, setup: Setup, machine: Machine) -> StepCost:
    """Predicted seconds of one decode step of ``shape`` placed as ``setup`` says."""
    host, gpu, layers = read_bytes(shape, setup)
    host_s = host / (machine.ram_bandwidth_gbs * 1e9 * DECODE_EFFICIENCY)
    if not gpu or machine.gpu is None:
        return StepCost(host_s + gpu / (machine.ram_bandwidth_gbs * 1e9 * DECODE_EFFICIENCY))
    return StepCost(host_s, gpu / (machine.gpu.bandwidth_gbs * 1e9 * DECODE_EFFICIENCY) + layers * GPU_LAYER_S)


def decode_speed(shape: ModelShape, setup: Setup, machine: Machine) -> float:
    """Plain tokens/s of ``shape`` placed as ``setup`` says."""
    return 1.0 / max(step_cost(shape, setup, machine).seconds, 1e-9)


def predicted_speedup(alpha: float, k: int, c_draft: float, verify_cost: float) -> float:
    """§0: E[tokens/round] / (k·c + c_verify(k)), in units of one target step."""
    if k <= 0:
        return 1.0
    return expected_tokens(alpha, k) / (k * c_draft + verify_cost)


def best_speedup(alpha: float, k_max: int, c_draft: float, target: StepCost) -> float:
    """The speedup at the best draft length up to ``k_max`` (the adaptive policy picks
    the length at run time; ``k_max`` only caps it)."""
    return max((predicted_speedup(alpha, k, c_draft, target.verify(k)) for k in range(1, k_max + 1)), default=1.0)


@dataclass(frozen=True)
class Predicted:
    """A placed pair's predicted speed."""

    plain: float
    """Plain tokens/s of the target."""
    speedup: float
    """Speculation's best speedup up to the draft cap (1.0 without a draft model)."""
    draft_cost: float = 0.0
    """The draft model's step over the target's (``c``)."""


def predict(machine: Machine, t_shape: ModelShape, t_setup: Setup, alpha: float, k: int,
            d_shape: ModelShape | None = None, d_setup: Setup | None = None) -> Predicted:
    """Plain tokens/s of the target placed as ``t_setup`` says and, with a draft model
    placed as ``d_setup`` says, the speedup its drafts are worth at acceptance ``alpha``."""
    t_step = step_cost(t_shape, t_setup, machine)
    plain = 1.0 / max(t_step.seconds, 1e-9)
    if d_shape is None or d_setup is None:
        return Predicted(plain, 1.0)
    c = step_cost(d_shape, d_setup, machine).seconds / max(t_step.seconds, 1e-9)
    return Predicted(plain, best_speedup(alpha, k, c, t_step), c)

