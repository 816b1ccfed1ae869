"""A llama.cpp build counts as offloading only when its device registry lists a local GPU."""

from __future__ import annotations

import pytest

from tandem.runtime.backends import llama_devices
from tandem.runtime.backends.llama_devices import (
    LlamaDevice,
    compiled_gpu_backends,
    offload_devices,
)

CPU = LlamaDevice("CPU", "Intel(R) Xeon(R) Processor", "cpu", "CPU")
RPC_PEER = LlamaDevice("RPC0[127.0.0.1:50052]", "RPC peer", "gpu", "RPC")
CUDA0 = LlamaDevice("CUDA0", "NVIDIA H200", "gpu", "CUDA", 140 * 1024**3, 141 * 1024**3)


def test_this_cpu_build_with_the_rpc_backend_does_not_offload() -> None:
    """This machine's build has the RPC backend (so llama_supports_gpu_offload() is true)
    but lists no GPU device: it must not count as offloading."""
    import llama_cpp

    devices = llama_devices.list_devices()
    assert devices is not None and devices[0].kind == "cpu"
    if any(d.offloads for d in devices):
        pytest.skip("this llama.cpp build lists a GPU (a CUDA/Metal build on its card)")
    assert [d.kind for d in devices] == ["cpu"]
    if not llama_cpp.llama_supports_rpc():
        pytest.skip("this llama.cpp build has no RPC backend")
    assert llama_cpp.llama_supports_gpu_offload()  # what the planner used to trust
    assert not llama_devices.gpu_offload_build()
    assert llama_devices.gpu_devices() == ()


def test_an_rpc_device_is_not_a_local_gpu() -> None:
    """The RPC backend reports each remote peer as a GPU-type device: it is not one this
    process can put layers on by n_gpu_layers."""
    assert offload_devices([CPU, RPC_PEER]) == ()
    assert offload_devices([CPU, RPC_PEER, CUDA0]) == (CUDA0,)
    assert offload_devices([LlamaDevice("Metal", "Apple M2", "igpu", "Metal")])[0].name == "Metal"
    assert offload_devices([LlamaDevice("BLAS", "OpenBLAS", "accel", "BLAS")]) == ()


def test_the_registry_decides_and_the_system_info_is_only_a_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llama_devices, "list_devices", lambda memory=False: (CPU, RPC_PEER))
    assert not llama_devices.gpu_offload_build()
    monkeypatch.setattr(llama_devices, "list_devices", lambda memory=False: (CPU, CUDA0))
    assert llama_devices.gpu_offload_build()
    assert llama_devices.gpu_devices() == (CUDA0,)
    # Without the registry's symbols: the compiled-in GPU backends named by the system info.
    import llama_cpp

    monkeypatch.setattr(llama_devices, "list_devices", lambda memory=False: None)
    monkeypatch.setattr(llama_cpp, "llama_print_system_info", lambda: b"CPU : AVX2 = 1 | RPC : 1 | ")
    assert not llama_devices.gpu_offload_build()
    monkeypatch.setattr(llama_cpp, "llama_print_system_info",
                        lambda: b"CUDA : ARCHS = 900 | USE_GRAPHS = 1 | PEER_MAX_BATCH_SIZE = 128 | CPU : AVX2 = 1 | ")
    assert llama_devices.gpu_offload_build()


def test_system_info_names_gpu_backends_only() -> None:
    assert compiled_gpu_backends("Metal : EMBED_LIBRARY = 1 | CPU : NEON = 1 |") == ("Metal",)
    assert compiled_gpu_backends("CPU : SSE3 = 1 | AVX = 1 | OPENMP = 1 | REPACK = 1 | ") == ()


def test_a_model_can_be_kept_off_every_gpu(stories260k) -> None:
    """``gpu_devices=False`` hands llama.cpp an empty device list (not NULL, which means
    every device): the baseline's tiny model measures host memory even on a CUDA build."""
    import ctypes

    from tandem.runtime.backends.llama import LlamaCppBackend
    from tandem.runtime.backends.llama_config import LlamaConfig, model_params

    params = model_params(LlamaConfig(n_gpu_layers=-1, gpu_devices=False))
    assert params.devices and ctypes.c_void_p.from_address(params.devices).value is None
    assert params.n_gpu_layers == 0
    assert not model_params(LlamaConfig()).devices  # NULL: llama.cpp's every device
    backend = LlamaCppBackend(stories260k, LlamaConfig(n_ctx=128, gpu_devices=False))
    try:
        assert backend.evaluate([1, 2, 3]).shape == (1, backend.n_vocab)
    finally:
        backend.close()


def test_ggml_calls_reach_the_copy_libllama_runs_on() -> None:
    """``llama_cpp._ggml`` opens a second copy of libggml (a second device registry, set
    up again over the same CUDA backend); ours is the one libllama is linked with. Checked
    in a fresh process: what this test session imported does not count."""
    import subprocess
    import sys

    code = (
        "import os\n"
        "from tandem.runtime.backends.llama_devices import gpu_offload_build, list_devices\n"
        "from tandem.runtime.backends.host_experts import cpu_buffer_type\n"
        "list_devices(memory=True); gpu_offload_build(); cpu_buffer_type()\n"
        "names = {line.split()[-1].rsplit('/', 1)[-1] for line in open('/proc/self/maps') if 'libggml.so' in line}\n"
        "print(sorted(names))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['libggml.so.0']"
