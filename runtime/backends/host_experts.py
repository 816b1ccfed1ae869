"""Keep a mixture-of-experts GGUF's expert tensors in host memory, everything else on the GPU.

In a MoE model the experts (``blk.N.ffn_{gate,up,down}_exps.weight``) are most of the
bytes but each token reads only the few its router picks, so they are the cheapest
weights to leave in host RAM when the model does not fit the card: llama.cpp runs those
matmuls on the CPU and keeps attention, routers, norms, shared experts and the KV cache
on the GPU. This is llama.cpp's ``--n-cpu-moe N`` (the experts of the first N blocks)
and ``-ot exps=CPU`` (all of them).

llama.cpp takes it as ``llama_model_params.tensor_buft_overrides``: a NULL-terminated
array of ``{const char *pattern; ggml_backend_buffer_type_t buft}`` (llama.h), each
pattern a regular expression searched in every tensor name, the first match winning.
llama-cpp-python declares the field as a bare pointer, so the array is built here with
ctypes, with the CPU buffer type taken from ggml's device registry. The array and its
pattern strings must outlive the load: :class:`HostExperts` owns them.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from tandem.errors import TandemError
from tandem.runtime.backends.ggml_lib import libggml

EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(?:up|down|gate)_exps\.weight$")
"""The routed experts' weights, and nothing else (not the router ``ffn_gate_inp``, not
the shared experts ``ffn_*_shexp``)."""

ALL_LAYERS = -1
"""``host_expert_layers`` value for every block's experts (``-ot exps=CPU``)."""


class _Override(ctypes.Structure):
    """``struct llama_model_tensor_buft_override`` (llama.h)."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def expert_layers(tensor_names: Iterable[str]) -> tuple[int, ...]:
    """The blocks that hold routed experts, in order (empty: a dense model)."""
    return tuple(sorted({int(m.group(1)) for n in tensor_names if (m := EXPERT_TENSOR.match(n))}))


def host_layers(n: int, layers: tuple[int, ...]) -> tuple[int, ...]:
    """The blocks whose experts stay in host memory for ``n`` (the first ``n`` of
    ``layers``; :data:`ALL_LAYERS`: all), or a clear error for a dense model or an ``n``
    the model has no room for."""
    if not layers:
        raise TandemError("This model has no expert tensors (blk.N.ffn_*_exps): keeping experts in host "
                          "memory applies to mixture-of-experts GGUFs only.")
    if n == ALL_LAYERS:
        return layers
    if not 0 <= n <= len(layers):
        raise TandemError(f"Experts of {n} layers in host memory: the model has experts in {len(layers)} "
                          f"layers; choose 0 to {len(layers)}, or {ALL_LAYERS} for all.")
    return layers[:n]


def layer_patterns(layers: Iterable[int]) -> tuple[str, ...]:
    """One anchored pattern per block, matching exactly that block's expert tensors."""
    return tuple(rf"^blk\.{i}\.ffn_(up|down|gate)_exps\.weight$" for i in layers)


def matched(patterns: Iterable[str], tensor_names: Iterable[str]) -> tuple[str, ...]:
    """Tensor names some pattern matches (as llama.cpp searches them)."""
    compiled = [re.compile(p) for p in patterns]
    return tuple(n for n in tensor_names if any(c.search(n) for c in compiled))


def cpu_buffer_type() -> int:
    """ggml's host buffer type, from the CPU device in ggml's registry."""

    lib = libggml()
    if lib is None:
        raise TandemError("This llama.cpp build has no ggml library to ask for its CPU buffer type.")
    lib.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    lib.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    lib.ggml_backend_dev_buffer_type.restype = ctypes.c_void_p
    lib.ggml_backend_dev_buffer_type.argtypes = [ctypes.c_void_p]
    dev = lib.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    buft = lib.ggml_backend_dev_buffer_type(dev) if dev else None
    if not buft:
        raise TandemError("llama.cpp lists no CPU device: cannot keep experts in host memory.")
    return int(buft)


@dataclass
class HostExperts:
    """The override array for one load, and the strings it points into (kept alive here)."""

    patterns: tuple[str, ...]
    tensors: tuple[str, ...]
    """The tensor names the patterns match: what llama.cpp will put in host memory."""
    _encoded: list[bytes] = field(default_factory=list, repr=False)
    _array: ctypes.Array | None = field(default=None, repr=False)

    @classmethod
    def for_model(cls, n: int, tensor_names: Iterable[str]) -> HostExperts:
        """The experts of the first ``n`` expert blocks (:data:`ALL_LAYERS`: all), checked
        against the model's own tensor names."""
        names = tuple(tensor_names)
        patterns = layer_patterns(host_layers(n, expert_layers(names)))
        return cls(patterns, matched(patterns, names))

    def apply(self, params) -> None:
        """Point ``params.tensor_buft_overrides`` at a NULL-terminated array for these
        patterns; nothing is set when there are none."""
        if not self.patterns:
            return
        buft = cpu_buffer_type()
        self._encoded = [p.encode() for p in self.patterns]
        self._array = (_Override * (len(self._encoded) + 1))()
        for slot, pattern in zip(self._array, self._encoded, strict=False):
            slot.pattern, slot.buft = pattern, buft
        # the last entry stays zeroed: pattern NULL ends the list
        params.tensor_buft_overrides = ctypes.cast(self._array, ctypes.c_void_p)
