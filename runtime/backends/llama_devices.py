"""Which devices this llama.cpp build can put layers on, as llama.cpp itself lists them.

``llama_supports_gpu_offload()`` is no answer: it is also true for a build that has the
RPC backend and nothing else (the RPC backend *could* reach a GPU on another machine),
so a CPU build with ``GGML_RPC=ON`` claims to offload. What counts here is ggml's
backend device registry (``ggml_backend_dev_count/get/type`` in ``ggml-backend.h``): a
build offloads only when it lists a device of type GPU or IGPU that is not an RPC
device (the RPC backend reports its remote devices as GPUs). A CUDA build on a machine
whose driver sees no card lists no CUDA device, so it does not count either.

Where the registry cannot be reached through ctypes (a build without the symbols), the
fallback is ``llama_print_system_info()``, which names the compiled-in GPU backends but
not whether a device exists: it only says whether one *could*.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from dataclasses import dataclass

from tandem.runtime.backends.ggml_lib import libggml

DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}
"""``enum ggml_backend_dev_type`` in ggml-backend.h (CPU, GPU, IGPU, ACCEL, META)."""

GPU_BACKENDS = ("CUDA", "Metal", "Vulkan", "ROCm", "HIP", "SYCL", "CANN", "MUSA", "OpenCL", "WebGPU")
"""Names ``llama_print_system_info`` gives compiled-in GPU backends (the fallback's list)."""


@dataclass(frozen=True)
class LlamaDevice:
    """One entry of ggml's device registry."""

    name: str
    """``CPU``, ``CUDA0``, ``Metal``, ``RPC0[host:port]``..."""
    description: str
    kind: str
    """One of :data:`DEVICE_TYPES`' values."""
    backend: str
    """The registry the device belongs to (``CPU``, ``CUDA``, ``RPC``...)."""
    free_bytes: int = 0
    total_bytes: int = 0

    @property
    def offloads(self) -> bool:
        """A local GPU llama.cpp can put layers and the KV cache on (not an RPC peer)."""
        return self.kind in ("gpu", "igpu") and not is_rpc(self)


def is_rpc(device: LlamaDevice) -> bool:
    return device.backend.upper().startswith("RPC") or device.name.upper().startswith("RPC")


def offload_devices(devices: Iterable[LlamaDevice]) -> tuple[LlamaDevice, ...]:
    """The devices of ``devices`` llama.cpp offloads to in this process (local GPUs)."""
    return tuple(d for d in devices if d.offloads)


def _ggml():
    """libllama's libggml (:mod:`tandem.runtime.backends.ggml_lib`) with the registry
    functions typed, or ``None`` when they are missing."""

    lib = libggml()
    if lib is None:
        return None
    try:
        lib.ggml_backend_dev_count.restype = ctypes.c_size_t
        lib.ggml_backend_dev_count.argtypes = []
        lib.ggml_backend_dev_get.restype = ctypes.c_void_p
        lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
        lib.ggml_backend_dev_type.restype = ctypes.c_int
        lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
        for fn in (lib.ggml_backend_dev_name, lib.ggml_backend_dev_description):
            fn.restype = ctypes.c_char_p
            fn.argtypes = [ctypes.c_void_p]
        lib.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
        lib.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
        lib.ggml_backend_reg_name.restype = ctypes.c_char_p
        lib.ggml_backend_reg_name.argtypes = [ctypes.c_void_p]
        lib.ggml_backend_dev_memory.restype = None
        lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                                ctypes.POINTER(ctypes.c_size_t)]
    except AttributeError:
        return None
    return lib


def _text(raw: bytes | None) -> str:
    return (raw or b"").decode("utf-8", "replace")


def list_devices(*, memory: bool = False) -> tuple[LlamaDevice, ...] | None:
    """Every device in ggml's registry, or ``None`` when the registry cannot be read.

    ``memory`` also asks each offloading device its free and total memory (on CUDA this
    creates the device's context: ask only where the model will be loaded anyway)."""
    lib = _ggml()
    if lib is None:
        return None
    out = []
    for i in range(int(lib.ggml_backend_dev_count())):
        dev = lib.ggml_backend_dev_get(i)
        if not dev:
            continue
        reg = lib.ggml_backend_dev_backend_reg(dev)
        found = LlamaDevice(_text(lib.ggml_backend_dev_name(dev)), _text(lib.ggml_backend_dev_description(dev)),
                            DEVICE_TYPES.get(int(lib.ggml_backend_dev_type(dev)), "unknown"),
                            _text(lib.ggml_backend_reg_name(reg)) if reg else "")
        if memory and found.offloads:
            free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
            lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
            found = LlamaDevice(found.name, found.description, found.kind, found.backend, free.value, total.value)
        out.append(found)
    return tuple(out)


def compiled_gpu_backends(system_info: str) -> tuple[str, ...]:
    """GPU backends named in ``llama_print_system_info()``'s text (``CUDA : ARCHS = 890 | ...``)."""
    names = []
    for part in system_info.split("|"):
        head = part.split(":", 1)[0].strip()
        if ":" in part and head in GPU_BACKENDS and head not in names:
            names.append(head)
    return tuple(names)


def gpu_offload_build() -> bool:
    """Whether llama.cpp, as built and on this machine, lists a local GPU to offload to."""
    devices = list_devices()
    if devices is not None:
        return bool(offload_devices(devices))
    import llama_cpp  # local: llama.cpp's libraries load only when this runs

    return bool(compiled_gpu_backends(_text(llama_cpp.llama_print_system_info())))


def gpu_devices() -> tuple[LlamaDevice, ...]:
    """The local GPUs llama.cpp offloads to, with their free and total memory."""
    return offload_devices(list_devices(memory=True) or ())
