"""The memory model against llama.cpp's own numbers and against measured resident memory.

Measurements run in fresh subprocesses (:mod:`tandem.runtime.memprobe`): peak RSS growth
from just before loading to after a prefill that fills the context, a verification-like
call and a few decode steps (what is counted is documented there).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.models.gguf_file import inspect_gguf
from tandem.runtime.memory_model import (
    KV_TYPE_SIZES,
    Setup,
    estimate,
    model_items,
    shape_from_gguf,
    shape_from_hf,
)
from tandem.runtime.memprobe import ProbeModel, ProbeSpec, measure

TOLERANCE = 0.10


@pytest.mark.parametrize("kv", ["f16", "q8_0", "f32"])
def test_kv_bytes_match_llama_backend(stories260k: Path, stories_twin: Path, kv: str) -> None:
    from tandem.runtime.llama_backend import kv_bytes_per_token

    for path in (stories260k, stories_twin):
        info = inspect_gguf(path)
        shape = shape_from_gguf(info)
        if shape.kv_type_ok(kv):
            assert shape.kv_bytes_per_token(kv, kv) == kv_bytes_per_token(info, kv, kv)


def test_shape_accounts_for_every_tensor(stories_twin: Path) -> None:
    info = inspect_gguf(stories_twin)
    shape = shape_from_gguf(info)
    assert shape.weights_bytes == info.weights_bytes
    assert len(shape.layer_bytes) == shape.n_layer
    assert shape.n_vocab == 512


def test_gpu_offload_moves_bytes_without_losing_any(stories_twin: Path) -> None:
    shape = shape_from_gguf(stories_twin)
    cpu = estimate(shape, Setup(1024), include_process=False)
    part = estimate(shape, Setup(1024, n_gpu_layers=2), include_process=False)
    full = estimate(shape, Setup(1024, n_gpu_layers=-1), include_process=False)

    def weights_kv(e, device=None):
        return sum(i.bytes for i in e.items if ("weights" in i.label or "KV" in i.label)
                   and (device is None or i.device == device))

    assert weights_kv(cpu) == weights_kv(part) == weights_kv(full)
    assert 0 < weights_kv(part, "gpu") < weights_kv(full, "gpu")
    # The output head moves only when every layer does; the embedding never does.
    assert weights_kv(full, "host") >= shape.input_bytes
    assert weights_kv(part, "gpu") == sum(shape.layer_bytes[-2:]) + 2 * shape.kv_bytes_per_token() * 1024 // shape.n_layer


def test_kv_quantization_and_context_scale_the_cache(stories_twin: Path) -> None:
    shape = shape_from_gguf(stories_twin)

    def kv(setup):
        return sum(i.bytes for i in model_items(shape, setup) if "KV" in i.label)

    assert kv(Setup(2048)) == 2 * kv(Setup(1024))
    block, size = KV_TYPE_SIZES["q8_0"]
    assert kv(Setup(1024, type_k="q8_0", type_v="q8_0")) == kv(Setup(1024)) * size // (2 * block)


def test_torch_shape_from_hf_config(tinystories656k_dir: Path) -> None:
    from safetensors import safe_open

    shape = shape_from_hf(tinystories656k_dir)
    with safe_open(str(tinystories656k_dir / "model.safetensors"), "numpy") as f:
        stored = sum(f.get_slice(k).get_shape()[0] * (f.get_slice(k).get_shape()[1:] or [1])[0] for k in f.keys())  # noqa: SIM118 (safetensors handle, not a dict)
    # Tied embeddings: the file stores the matrix once, the shape prices it once.
    assert shape.n_params == stored
    assert shape.weights_bytes == 4 * stored


def _check(spec: ProbeSpec, predicted: int) -> None:
    measured = measure(spec)["peak_bytes"]
    error = predicted / measured - 1
    print(f"memory model: predicted {predicted} vs measured {measured} ({error:+.1%})")
    assert abs(error) <= TOLERANCE, f"predicted {predicted} vs measured {measured} ({error:+.1%})"


@pytest.mark.parametrize(("ctx", "batch"), [(256, 256), (1024, 256), (2048, 64)])
def test_predicted_peak_matches_measured_fixture(stories260k: Path, ctx: int, batch: int) -> None:
    shape = shape_from_gguf(stories260k)
    setup = Setup(ctx, batch, output_rows=5)
    spec = ProbeSpec([ProbeModel(str(stories260k), ctx, batch, prompt_tokens=ctx - 16, output_rows=5)])
    _check(spec, estimate(shape, setup).host)


@pytest.mark.parametrize(("ctx", "draft_ctx", "k", "kv"), [(512, 512, 4, "f16"), (1024, 256, 8, "f16"), (256, 1024, 2, "f32")])
def test_predicted_peak_matches_measured_twin_pair(stories_twin: Path, stories260k: Path, ctx: int,
                                                   draft_ctx: int, k: int, kv: str) -> None:
    t_shape, d_shape = shape_from_gguf(stories_twin), shape_from_gguf(stories260k)
    t_setup = Setup(ctx + k, 256, kv, kv, output_rows=k + 1)
    d_setup = Setup(draft_ctx + k + 1, 64)
    spec = ProbeSpec([
        ProbeModel(str(stories_twin), ctx + k, 256, type_k=kv, type_v=kv, prompt_tokens=ctx - 16, output_rows=k + 1),
        ProbeModel(str(stories260k), draft_ctx + k + 1, 64, prompt_tokens=draft_ctx - 16),
    ])
    predicted = estimate(t_shape, t_setup, d_shape, d_setup, k=k)
    # The probe holds no drafter q rows (Python-side speculation buffers): leave them out.
    _check(spec, predicted.host - predicted.total(role="speculation"))
