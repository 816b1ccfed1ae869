"""What a split of a model over llama.cpp RPC devices is.

The planner (:mod:`tandem.runtime.planning.rpc_devices`) prices a split from what each
server reports; the backend (:mod:`tandem.runtime.backends.rpc`) applies one. Both use
these types, which sit here, below both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.errors import TandemError


def format_size(n: int) -> str:
    """Bytes in MiB, or GiB from 10 GiB on (the backends may not import the planner's
    :func:`~tandem.runtime.planning.hardware.format_size`)."""
    return f"{n / 2**30:.1f} GiB" if n >= 10 * 2**30 else f"{n / 2**20:.0f} MiB"


@dataclass(frozen=True)
class RemoteDevice:
    """One device an RPC server offers, with the memory it reported."""

    endpoint: str
    """``host:port`` of the server."""
    index: int
    """The device's index on that server (a server may offer several GPUs)."""
    free: int
    total: int

    @property
    def label(self) -> str:
        return self.endpoint if self.index == 0 else f"{self.endpoint}#{self.index}"


@dataclass(frozen=True)
class DeviceShare:
    """What one device holds of the split model and what it has for it."""

    label: str
    layers: int
    weights: int
    kv: int
    compute: int
    available: int

    @property
    def need(self) -> int:
        return self.weights + self.kv + self.compute

    @property
    def fits(self) -> bool:
        return self.need <= self.available


@dataclass(frozen=True)
class RpcSplit:
    """Blocks per device, local first, then each remote device in the order given."""

    local_layers: int
    remote_layers: tuple[int, ...]
    shares: tuple[DeviceShare, ...]

    @property
    def layers(self) -> tuple[int, ...]:
        """``LlamaConfig.rpc_layers``: this machine's blocks, then each RPC device's."""
        return (self.local_layers, *self.remote_layers)

    def summary(self) -> str:
        """One line for a front end's notes."""
        if not self.shares:
            return f"RPC split: this machine {self.local_layers} layers, the servers {list(self.remote_layers)}"
        return "RPC split: " + ", ".join(f"{s.label} {s.layers} layers" for s in self.shares)

    def describe(self) -> str:
        return "\n".join(
            f"  {s.label}: {s.layers} layers, {format_size(s.need)} (weights {format_size(s.weights)}, "
            f"KV {format_size(s.kv)}, compute {format_size(s.compute)}) of {format_size(s.available)}"
            for s in self.shares)


def pinned_split(n_layer: int, layers: Sequence[int], remote: Sequence[RemoteDevice]) -> RpcSplit:
    """A split the caller chose: ``layers`` blocks for this machine, then each RPC device
    (not priced: for tests and benchmarks that place blocks on purpose)."""
    if len(layers) != len(remote) + 1 or sum(layers) != n_layer or min(layers) < 0:
        raise TandemError(f"A pinned split lists blocks for this machine and each of the {len(remote)} RPC "
                          f"device(s), {len(remote) + 1} numbers adding up to {n_layer}; got {list(layers)}.")
    return RpcSplit(layers[0], tuple(layers[1:]), ())
