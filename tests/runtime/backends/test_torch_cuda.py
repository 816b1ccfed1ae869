"""The torch engine on CUDA gives what it gives on CPU (skipped where torch sees no GPU).

Kept apart from test_torch_engine.py, and free of llama.cpp imports, so it runs on a GPU
box that has torch but not the llama.cpp bindings. fp32 matmuls on CUDA do not use TF32
unless asked, so CPU and GPU agree to float32 rounding (``TOL``); bf16 is lossy and only
its greedy agreement is reported.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from greedy_runs import greedy_rows

from tandem.runtime.backends.torch_engine.backend import TorchBackend, TorchConfig
from tandem.runtime.backends.torch_engine.cache import KVCache
from tandem.runtime.backends.torch_engine.decoder import LlamaModel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
TOL = 1e-3
PROMPTS = ["Once upon a time", "The little dog", "Lily and Ben went to the park. They", "Tom was sad because"]


def test_hf_model_cuda_equals_cpu(tinystories656k_dir: Path) -> None:
    cpu = TorchBackend(tinystories656k_dir, TorchConfig(device="cpu"))
    gpu = TorchBackend(tinystories656k_dir)  # default device: CUDA when available
    assert gpu.device.type == "cuda" and gpu.memory().device.startswith("cuda")
    for text in PROMPTS:
        ids = cpu.tokenize(text, add_bos=True)
        a, rows_a = greedy_rows(cpu, ids, 24)
        b, rows_b = greedy_rows(gpu, ids, 24)
        assert a == b
        np.testing.assert_allclose(rows_a, rows_b, atol=TOL)


def test_gguf_weights_on_cuda(stories260k: Path) -> None:
    pytest.importorskip("gguf")
    from tandem.runtime.backends.torch_engine.loader import load_gguf

    outs = []
    for device in ("cpu", "cuda"):
        cfg, weights = load_gguf(stories260k, torch.float32, device)
        model = LlamaModel(cfg, weights).eval()
        cache = KVCache(cfg.n_layer, cfg.n_head_kv, cfg.head_dim, device=device, capacity=4)
        ids = torch.arange(1, 301, device=device) % cfg.n_vocab  # grows the cache past its capacity
        with torch.inference_mode():
            logits = model(model.embed(ids), torch.arange(300, device=device), cache)
        cache.commit(300)
        outs.append(logits.cpu().numpy())
    np.testing.assert_allclose(outs[0], outs[1], atol=TOL)


def test_tree_and_truncate_on_cuda(tinystories656k_dir: Path) -> None:
    gpu = TorchBackend(tinystories656k_dir, TorchConfig(device="cuda"))
    prompt = gpu.tokenize("Once upon a time", add_bos=True)
    tokens, parents = [300, 301, 302, 303], [-1, 0, 0, -1]
    gpu.evaluate(prompt)
    tree = gpu.evaluate_tree(tokens, parents)
    for node, path in {0: [0], 1: [0, 1], 2: [0, 2], 3: [3]}.items():
        gpu.truncate(len(prompt))
        np.testing.assert_allclose(tree[node], gpu.evaluate([tokens[i] for i in path])[-1], atol=1e-4)
    gpu.truncate(len(prompt))
    first = gpu.evaluate([5, 6, 7], range(3))
    gpu.truncate(len(prompt))
    np.testing.assert_array_equal(first, gpu.evaluate([5, 6, 7], range(3)))


def test_bfloat16_on_cuda_runs(tinystories656k_dir: Path) -> None:
    ref = TorchBackend(tinystories656k_dir, TorchConfig(device="cuda"))
    half = TorchBackend(tinystories656k_dir, TorchConfig(device="cuda", dtype="bfloat16"))
    agree = total = 0
    for text in PROMPTS:
        ids = ref.tokenize(text, add_bos=True)
        a, _ = greedy_rows(ref, ids, 24)
        b, _ = greedy_rows(half, ids, 24)
        agree += next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        total += len(a)
    print(f"bf16 greedy prefix agreement with fp32 on CUDA: {agree}/{total}")
    assert half.memory().weights * 2 == ref.memory().weights
    assert agree > 0
