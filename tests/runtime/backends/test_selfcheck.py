"""Setup's self-check decodes on the GPU as well when the llama.cpp build offloads."""

from __future__ import annotations

import pytest

from tandem.runtime.backends import llama_devices, selfcheck
from tandem.runtime.backends.llama_devices import LlamaDevice

CUDA0 = LlamaDevice("CUDA0", "NVIDIA H200", "gpu", "CUDA")


def _record(monkeypatch: pytest.MonkeyPatch, fail_on_gpu: bool = False) -> list[int]:
    """Runs of the decoding child, by ``n_gpu_layers`` (the child itself is tested in
    tests/runtime/test_real_models.py and, on a GPU, in tests/gpu)."""
    seen: list[int] = []

    def decode(path, timeout_s=120.0, n_gpu_layers=0):
        seen.append(n_gpu_layers)
        return "the decoding child died of SIGSEGV (a crash inside native code)" if fail_on_gpu and n_gpu_layers else None

    monkeypatch.setattr(selfcheck, "decode_in_child", decode)
    return seen


def test_an_offloading_build_decodes_each_type_on_cpu_and_gpu(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    seen = _record(monkeypatch)
    monkeypatch.setattr(llama_devices, "gpu_offload_build", lambda: True)
    monkeypatch.setattr(llama_devices, "gpu_devices", lambda: (CUDA0,))
    assert selfcheck.main() == 0
    assert seen == [0, -1] * len(selfcheck.QUANT_TYPES)
    assert "on this CPU and on the GPU (CUDA0: NVIDIA H200)" in capsys.readouterr().out


def test_a_cpu_build_decodes_on_the_cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _record(monkeypatch)
    monkeypatch.setattr(llama_devices, "gpu_offload_build", lambda: False)
    assert selfcheck.main() == 0 and set(seen) == {0}


def test_a_gpu_crash_names_the_gpu_and_the_way_back_to_a_cpu_build(monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    _record(monkeypatch, fail_on_gpu=True)
    monkeypatch.setattr(llama_devices, "gpu_offload_build", lambda: True)
    assert selfcheck.main() == 1
    err = capsys.readouterr().err
    assert "q4_0 on the GPU: the decoding child died of SIGSEGV" in err
    assert "TANDEM_CUDA=0" in err and "on this CPU. The usual cause" not in err


def test_the_gpu_run_of_the_child_decodes_here(tmp_path) -> None:
    """The child with every layer asked on the GPU decodes on any build (a CPU build keeps
    them on the CPU), so the GPU run is a real run, not a flag the child ignores by failing."""
    from tandem.models.quantize import quantize_gguf

    f32 = selfcheck.write_tiny_llama(tmp_path / "tiny.gguf")
    quantize_gguf(f32, tmp_path / "tiny-q4_0.gguf", "q4_0")
    assert selfcheck.decode_in_child(tmp_path / "tiny-q4_0.gguf", n_gpu_layers=-1) is None
