"""Pricing a target split over this machine and llama.cpp RPC servers.

The layers of a model split by ``--rpc`` run one after another: this machine keeps the
token embedding, the first ``local_layers`` blocks and the output head (so only one
hidden-state row per token crosses the network, never a row of logits), and each RPC
device holds a contiguous run of the remaining blocks with their KV cache. Each device's
share is priced from the GGUF header (weights of its blocks, KV of its blocks at the
padded context, a compute reserve for one ubatch) against what it has: this machine's
budget after what stays local, and for an RPC device the free memory its server reports
(``tandem rpc-server`` reports MemAvailable, capped by ``--mem``), less
:data:`REMOTE_HEADROOM`.

Blocks are dealt in proportion to what each device can hold, so every machine is left
the same share of headroom; a split that does not fit is refused with what each device
would need, before anything is loaded or sent.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

from tandem.errors import TandemError
from tandem.models.gguf_file import inspect_gguf
from tandem.runtime.backends.rpc_probe import parse_endpoints, query_server
from tandem.runtime.backends.rpc_split import DeviceShare, RemoteDevice, RpcSplit, format_size
from tandem.runtime.planning.shapes import KV_PAD, ModelShape, shape_from_gguf

REMOTE_HEADROOM = 0.9
"""Share of a server's reported free memory a plan may use: the server process itself
and the allocator's rounding take some, and its machine keeps running other things."""
LOCAL_HEADROOM = 0.85
"""Share of this machine's available memory a default split may use (as the planner's
host budget; a front end passes its own budget instead)."""


def available_here() -> int:
    """This machine's available memory (MemAvailable; sysconf's free pages elsewhere)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_per_layer(shape: ModelShape, n_ctx: int, type_k: str = "f16", type_v: str = "f16") -> int:
    """KV bytes one block holds at ``n_ctx`` (llama.cpp pads the cells to :data:`KV_PAD`)."""
    cells = math.ceil(n_ctx / KV_PAD) * KV_PAD
    return shape.kv_bytes_per_token(type_k, type_v) // max(shape.n_layer, 1) * cells


def compute_reserve(shape: ModelShape, n_ctx: int, n_batch: int) -> int:
    """Bytes a device's compute buffer takes for one ubatch through its blocks: the f32
    attention scores of all heads, the feed-forward activations and a few hidden-state
    rows (an upper bound of llama.cpp's graph allocation, which reuses memory)."""
    t = min(n_batch, n_ctx)
    cells = math.ceil(n_ctx / KV_PAD) * KV_PAD
    return 4 * t * (shape.n_head * cells + 3 * shape.n_ff + 4 * shape.n_embd)


def local_fixed(shape: ModelShape, n_ctx: int, n_batch: int) -> int:
    """What stays on this machine whatever the split: embedding, output head, and the
    logits of a full ubatch in the compute buffer."""
    return shape.input_bytes + shape.output_bytes + 4 * min(n_batch, n_ctx) * shape.n_vocab


def drafter_reserve(shape: ModelShape, n_ctx: int, n_batch: int) -> int:
    """What a drafter running on this machine takes: weights, KV, compute, logits."""
    return (shape.weights_bytes + kv_per_layer(shape, n_ctx) * shape.n_layer
            + compute_reserve(shape, n_ctx, n_batch) + 4 * min(n_batch, n_ctx) * shape.n_vocab)


def _shares(shape: ModelShape, counts: Sequence[int], labels: Sequence[str], available: Sequence[int],
            n_ctx: int, n_batch: int, kv_layer: int, fixed: int) -> tuple[DeviceShare, ...]:
    out, start = [], 0
    for i, (n, label, have) in enumerate(zip(counts, labels, available, strict=True)):
        weights = sum(shape.layer_bytes[start:start + n]) + (fixed if i == 0 else 0)
        out.append(DeviceShare(label, n, weights, kv_layer * n,
                               compute_reserve(shape, n_ctx, n_batch) if n or i == 0 else 0, have))
        start += n
    return tuple(out)


def _proportional(costs: Sequence[int], room: Sequence[int]) -> list[int]:
    """Blocks per device, contiguous, each device's run ending where the cumulative cost
    reaches its cumulative share of ``room``."""
    total_room = sum(max(r, 0) for r in room) or 1
    total_cost = sum(costs)
    counts, layer, acc_room, acc_cost = [], 0, 0, 0
    for i, r in enumerate(room):
        acc_room += max(r, 0)
        goal = total_cost * acc_room / total_room
        start = layer
        while layer < len(costs) and (i == len(room) - 1 or acc_cost + costs[layer] / 2 <= goal):
            acc_cost += costs[layer]
            layer += 1
        counts.append(layer - start)
    return counts


def _in_order(costs: Sequence[int], room: Sequence[int]) -> list[int]:
    """Blocks per device filling each to its room in turn (the fallback when rounding
    the proportional split overfills one device)."""
    counts, layer = [], 0
    for r in room:
        start, used = layer, 0
        while layer < len(costs) and used + costs[layer] <= r:
            used += costs[layer]
            layer += 1
        counts.append(layer - start)
    counts[-1] += len(costs) - layer
    return counts


def plan_split(shape: ModelShape, remote: Sequence[RemoteDevice], *, local_available: int,
               n_ctx: int, n_batch: int = 512, type_k: str = "f16", type_v: str = "f16",
               local_layers: int | None = None) -> RpcSplit:
    """Split ``shape``'s blocks over this machine (``local_available`` bytes for the
    target after the drafter and the runtime) and ``remote``; ``local_layers`` pins
    this machine's share. Raises :class:`TandemError` naming each device's need and
    room when the model does not fit."""
    if not remote:
        raise TandemError("An RPC split needs at least one RPC server.")
    kv_layer = kv_per_layer(shape, n_ctx, type_k, type_v)
    fixed = local_fixed(shape, n_ctx, n_batch)
    reserve = compute_reserve(shape, n_ctx, n_batch)
    available = [local_available] + [int(d.free * REMOTE_HEADROOM) for d in remote]
    labels = ["this machine"] + [d.label for d in remote]
    room = [available[0] - fixed - reserve] + [a - reserve for a in available[1:]]
    costs = [b + kv_layer for b in shape.layer_bytes]
    if local_layers is not None:
        if not 0 <= local_layers <= shape.n_layer:
            raise TandemError(f"This machine's share must be between 0 and {shape.n_layer} blocks.")
        rest = costs[local_layers:]
        candidates = [[local_layers, *c] for c in (_proportional(rest, room[1:]), _in_order(rest, room[1:]))]
    else:
        candidates = [_proportional(costs, room), _in_order(costs, room)]
    for counts in candidates:
        shares = _shares(shape, counts, labels, available, n_ctx, n_batch, kv_layer, fixed)
        if all(s.fits for s in shares):
            return RpcSplit(counts[0], tuple(counts[1:]), shares)
    shares = _shares(shape, candidates[0], labels, available, n_ctx, n_batch, kv_layer, fixed)
    need = sum(costs) + fixed + reserve * len(shares)
    raise TandemError(
        f"{shape.name} does not fit on this machine and {len(remote)} RPC device(s) at a context of "
        f"{n_ctx}: it needs about {format_size(need)} in all, they have {format_size(sum(available))} "
        f"(servers: {REMOTE_HEADROOM:.0%} of the free memory they report). Per device:\n"
        f"{RpcSplit(candidates[0][0], tuple(candidates[0][1:]), shares).describe()}\n"
        "Add a server, give a server more memory (tandem rpc-server --mem), lower --ctx, "
        "or quantize the KV cache.")


def plan_remote(target: str | os.PathLike[str], endpoints: Sequence[str], *, local_budget: int | None = None,
                n_ctx: int | None = None, n_batch: int = 512, kv_type: str = "f16",
                drafter: str | os.PathLike[str] | None = None) -> tuple[RpcSplit, int]:
    """The split a front end opens ``target`` with (and its context): each server's
    share priced against the memory it reports, this machine's against ``local_budget``
    (default: its share of available memory) less what a local ``drafter`` takes."""
    info = inspect_gguf(target)
    trained = int(info.arch_value("context_length", 2048) or 2048)
    ctx = n_ctx or min(trained, 4096)
    remote = tuple(d for e in parse_endpoints(endpoints) for d in query_server(e))
    local = local_budget if local_budget is not None else int(available_here() * LOCAL_HEADROOM)
    if drafter is not None and Path(drafter).is_file():
        local -= drafter_reserve(shape_from_gguf(drafter), ctx, n_batch)
    split = plan_split(shape_from_gguf(info), remote, local_available=local, n_ctx=ctx, n_batch=n_batch,
                       type_k=kv_type, type_v=kv_type)
    return split, ctx
