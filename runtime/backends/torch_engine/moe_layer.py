"""Mixture-of-experts feed-forward: a router plus experts behind one call.

The layout is llama.cpp's (``blk.N.ffn_gate_inp`` router, ``ffn_{gate,up,down}_exps``
expert stacks, optional ``*_shexp`` shared expert with a sigmoid gate as in Qwen2-MoE).
Routing is softmax over all experts, top-k, and (Mixtral) renormalisation of the chosen
weights, exactly as llama.cpp's ``build_moe_ffn`` does.

Every expert computation goes through :meth:`ExpertStore.run`, so an offloaded store
(experts on disk or in host RAM, a byte-budgeted device cache, prefetch, mixed
precision) replaces :class:`DenseExperts` without touching the model code.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T (+ b)`` for ``w`` of shape (out, in).

    Written as a matmul rather than ``F.linear`` so ONNX export emits ``MatMul`` (which
    onnxruntime's dynamic int8 quantization handles) instead of ``Gemm``; eager torch
    runs the same BLAS call either way.
    """
    y = torch.matmul(x, w.t())
    return y if b is None else y + b


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate x) * up x)``: the Llama feed-forward."""
    return linear(F.silu(linear(x, gate)) * linear(x, up), down)


class ExpertStore(Protocol):
    """Where expert weights live and how a routed batch is computed."""

    def run(self, layer: int, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Mix of experts for each row of ``x`` (T, dim).

        ``experts`` (T, k) are expert ids and ``weights`` (T, k) their mixing weights;
        returns (T, dim) = sum_j weights[t, j] * expert_{experts[t, j]}(x[t]).
        """
        ...


Batch = tuple[int, torch.Tensor, torch.Tensor, float]
"""(expert id, its rows of x, their mixing weights, the largest of them)."""


def expert_batches(experts: torch.Tensor, weights: torch.Tensor, device: torch.device) -> list[Batch]:
    """Group routed rows by expert, experts ascending, from *host* copies of the routing.

    The caller reads the routing to the host once per layer (``.cpu()``); grouping there
    avoids a device synchronisation per expert (``nonzero``, ``unique``), which on a GPU
    costs more than the expert's matmuls at decode batch sizes. Every store uses this,
    so offloaded and resident experts compute in the same order with the same kernels.
    """
    out = []
    for e in sorted(set(experts.flatten().tolist())):
        rows, slot = torch.nonzero(experts == e, as_tuple=True)
        w = weights[rows, slot]
        out.append((e, rows.to(device), w.to(device), float(w.max())))
    return out


def mix(x: torch.Tensor, batches: list[tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]]) -> torch.Tensor:
    """``sum_e w * expert_e(x[rows])`` scattered back to rows; batches are (rows, w, (gate, up, down))."""
    out = torch.zeros_like(x)
    for rows, w, (gate, up, down) in batches:
        y = swiglu(x[rows], gate, up, down)
        out.index_add_(0, rows, y * w[:, None].to(y.dtype))
    return out


class DenseExperts(nn.Module):
    """All experts resident as stacked tensors (E, out, in): the reference store."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.gate = nn.Parameter(gate, requires_grad=False)
        self.up = nn.Parameter(up, requires_grad=False)
        self.down = nn.Parameter(down, requires_grad=False)

    def run(self, layer: int, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        batches = expert_batches(experts.cpu(), weights.cpu(), x.device)
        return mix(x, [(rows, w, (self.gate[e], self.up[e], self.down[e])) for e, rows, w, _ in batches])


class MoEFeedForward(nn.Module):
    """Router + experts (+ optional shared expert) for one layer."""

    def __init__(
        self,
        layer: int,
        router: torch.Tensor,
        store: ExpertStore,
        n_used: int,
        *,
        normalize: bool = True,
        shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        shared_gate: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.layer = layer
        self.router = nn.Parameter(router, requires_grad=False)
        self.store = store
        self.n_used = n_used
        self.normalize = normalize
        self.shared = nn.ParameterList([nn.Parameter(t, requires_grad=False) for t in shared or ()])
        self.shared_gate = None if shared_gate is None else nn.Parameter(shared_gate, requires_grad=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ids and mixing weights (T, k); public so a prefetcher can apply it early."""
        probs = torch.softmax(linear(x, self.router).float(), dim=-1)
        weights, experts = torch.topk(probs, self.n_used, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        out = self.store.run(self.layer, x, experts, weights)
        if len(self.shared):
            y = swiglu(x, self.shared[0], self.shared[1], self.shared[2])
            if self.shared_gate is not None:
                y = y * torch.sigmoid(linear(x, self.shared_gate.reshape(1, -1)))
            out = out + y
        return out
