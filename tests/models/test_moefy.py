"""MoEfication: neuron split, router training and the llama.cpp MoE GGUF layout."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tandem.errors import TandemError
from tandem.models.gguf_file import inspect_gguf
from tandem.models.moefy import (
    DenseFFN,
    MoefyConfig,
    balanced_kmeans,
    expert_outputs,
    moefy_layer,
    read_dense_ffns,
    split_experts,
    write_moe_gguf,
)


def test_balanced_kmeans_partitions_into_equal_groups() -> None:
    rng = np.random.default_rng(0)
    feats = np.concatenate([rng.normal(c, 0.1, (10, 4)) for c in (-3, 0, 3)])  # 3 clear clusters
    groups = balanced_kmeans(feats, 3, 10, 0)
    assert sorted(np.concatenate(groups).tolist()) == list(range(30))
    assert [len(g) for g in groups] == [10, 10, 10]
    assert sorted(tuple(sorted(g.tolist())) for g in groups) == [tuple(range(i, i + 10)) for i in (0, 10, 20)]


def test_all_experts_sum_to_the_dense_ffn() -> None:
    rng = np.random.default_rng(1)
    ffn = DenseFFN(*(rng.normal(0, 0.3, s).astype(np.float32) for s in ((30, 8), (30, 8), (8, 30))))
    groups = balanced_kmeans(np.concatenate((ffn.gate, ffn.up), 1), 4, 5, 0)  # 30/4: padded to 8 wide
    x = torch.randn(5, 8)
    dense = torch.nn.functional.silu(x @ torch.from_numpy(ffn.gate).T) * (x @ torch.from_numpy(ffn.up).T)
    dense = dense @ torch.from_numpy(ffn.down).T
    moe = expert_outputs(x, *split_experts(ffn, groups)).sum(1)
    torch.testing.assert_close(moe, dense, atol=1e-5, rtol=1e-5)


def test_gguf_layout_is_exact_with_all_experts(stories260k: Path, tmp_path: Path) -> None:
    """top-k = E and a zero router make every weight 1/E (x E in down): the dense model in llama.cpp."""
    from tandem.runtime.backends.llama import LlamaCppBackend
    from tandem.runtime.backends.llama_config import LlamaConfig

    reader, dense = read_dense_ffns(stories260k)
    cfg = MoefyConfig(n_experts=4, top_k=4, router_steps=5)
    x = np.random.default_rng(0).normal(size=(64, 64)).astype(np.float32)
    layers = [moefy_layer(f, x, cfg, i) for i, f in enumerate(dense)]
    out = write_moe_gguf(reader, layers, tmp_path / "exact.gguf", top_k=4, router_scale=0.0)
    ref = LlamaCppBackend(stories260k, LlamaConfig(n_ctx=128))
    moe = LlamaCppBackend(out, LlamaConfig(n_ctx=128))
    ids = ref.tokenize("Once upon a time, there was", add_bos=True)
    rows = list(range(len(ids)))
    np.testing.assert_allclose(moe.evaluate(ids, rows), ref.evaluate(ids, rows), atol=2e-3)
    ref.close()
    moe.close()


def test_moefied_gguf_loads_in_llama_cpp_and_torch(stories_moe: Path) -> None:
    from tandem.runtime.backends.llama import LlamaCppBackend
    from tandem.runtime.backends.llama_config import LlamaConfig
    from tandem.runtime.backends.torch_engine.backend import TorchBackend, TorchConfig

    info = inspect_gguf(stories_moe)
    assert info.arch_value("expert_count") == 8 and info.arch_value("expert_used_count") == 2
    names = {t.name: t.shape for t in info.tensors}
    assert names["blk.0.ffn_gate_inp.weight"] == (64, 8)
    assert names["blk.0.ffn_gate_exps.weight"] == (64, 22, 8)  # 172 neurons / 8 -> 22 wide (padded)
    assert names["blk.0.ffn_down_exps.weight"] == (22, 64, 8)
    assert "blk.0.ffn_gate.weight" not in names
    lc = LlamaCppBackend(stories_moe, LlamaConfig(n_ctx=128))
    tb = TorchBackend(stories_moe, TorchConfig(device="cpu", n_threads=1))
    ids = lc.tokenize("Once upon a time", add_bos=True)
    a, b = lc.evaluate(ids), tb.evaluate(ids)
    # Same routing and weights in both runtimes; 1e-2 is what the dense model itself shows.
    np.testing.assert_allclose(a, b, atol=1e-2)
    out = []
    for _ in range(12):
        out.append(int(a[-1].argmax()))
        a = lc.evaluate(out[-1:])
    assert len(out) == 12 and len(set(out)) > 2  # generates text, not one repeated token
    lc.close()


def test_routing_is_input_dependent(stories_moe: Path) -> None:
    from tandem.runtime.backends.torch_engine.backend import TorchBackend, TorchConfig

    tb = TorchBackend(stories_moe, TorchConfig(device="cpu", n_threads=1))
    chosen: list[set[tuple[int, ...]]] = [set() for _ in range(tb.model_config.n_layer)]
    for block in tb.model.blocks:
        original = block.ffn.route

        def spy(x, original=original, layer=block.layer):
            experts, weights = original(x)
            chosen[layer].update(tuple(sorted(r)) for r in experts.tolist())
            return experts, weights

        block.ffn.route = spy
    ids = tb.tokenize("Once upon a time, there was a little girl named Lily. She liked to play with her dog.", add_bos=True)
    tb.evaluate(ids)
    assert all(len(c) >= 4 for c in chosen)  # many different expert pairs across tokens


def test_moefy_rejects_bad_arguments(stories260k: Path, tmp_path: Path) -> None:
    from tandem.app.commands.moefy import moefy_file

    with pytest.raises(TandemError, match="top-k"):
        moefy_file(stories260k, tmp_path / "x.gguf", 4, 5)
    with pytest.raises(TandemError):
        moefy_file(tmp_path / "missing.gguf", tmp_path / "x.gguf", 4, 2)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all" * 4)
    with pytest.raises(TandemError):
        moefy_file(bad, tmp_path / "x.gguf", 4, 2)


def test_moefy_cli_reports_errors(tmp_path: Path) -> None:
    from tandem.app.cli import main

    assert main(["moefy", str(tmp_path / "nope.gguf"), "-o", str(tmp_path / "o.gguf")]) != 0
