"""llama.cpp's quantized KV types (q8_0, q4_0) on a model with 32-wide heads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play"


def _head32_model(stories260k: Path, out: Path) -> Path:
    """A random-weight Llama GGUF with 32-wide heads and stories260K's vocabulary.

    llama.cpp's quantized KV types pack 32 values per block, so they need heads at
    least that wide; every fixture model has 8- or 16-wide heads (twins keep the head
    width). Random weights with a realistic scale are enough to check that the types
    load and generate, and how far their logits move from f16.
    """
    import gguf

    reader = gguf.GGUFReader(stories260k)
    dim, heads, kv_heads, ff, layers, vocab = 128, 4, 2, 256, 2, 512
    w = gguf.GGUFWriter(str(out), "llama")
    for f in reader.fields.values():
        if f.name.startswith("tokenizer."):
            vt = f.types[0]
            w.add_key_value(f.name, f.contents(), vt, sub_type=f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None)
    w.add_context_length(256)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(ff)
    w.add_block_count(layers)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(dim // heads)
    w.add_layer_norm_rms_eps(1e-5)
    rng = np.random.default_rng(0)

    def t(name: str, *shape: int, scale: float | None = None) -> None:
        a = np.ones(shape, np.float32) if scale is None else rng.normal(0, scale, shape).astype(np.float32)
        w.add_tensor(name, a)

    t("token_embd.weight", vocab, dim, scale=1.0)
    t("output_norm.weight", dim)
    t("output.weight", vocab, dim, scale=dim**-0.5)
    for i in range(layers):
        p = f"blk.{i}."
        t(p + "attn_norm.weight", dim)
        t(p + "ffn_norm.weight", dim)
        t(p + "attn_q.weight", dim, dim, scale=dim**-0.5)
        t(p + "attn_k.weight", dim // 2, dim, scale=dim**-0.5)
        t(p + "attn_v.weight", dim // 2, dim, scale=dim**-0.5)
        t(p + "attn_output.weight", dim, dim, scale=dim**-0.5)
        t(p + "ffn_gate.weight", ff, dim, scale=dim**-0.5)
        t(p + "ffn_up.weight", ff, dim, scale=dim**-0.5)
        t(p + "ffn_down.weight", dim, ff, scale=ff**-0.5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_llama_cpp_quantized_kv_loads_and_generates(stories260k: Path, tmp_path: Path, kv_type: str) -> None:
    from tandem.runtime.backends.llama import LlamaCppBackend
    from tandem.runtime.backends.llama_config import LlamaConfig

    model = _head32_model(stories260k, tmp_path / "head32.gguf")
    ref = LlamaCppBackend(model, LlamaConfig(n_ctx=256))
    q = LlamaCppBackend(model, LlamaConfig(n_ctx=256, type_k=kv_type, type_v=kv_type))
    try:
        assert q.kv_bytes_per_token < ref.kv_bytes_per_token / 1.8
        ids = ref.tokenize(PROMPT, add_bos=True)
        lr, lq = ref.evaluate(ids), q.evaluate(ids)
        agree, kl = 0, []
        for _ in range(32):
            t = int(lr[-1].argmax())
            agree += int(lq[-1].argmax()) == t
            pr, pq = (torch.log_softmax(torch.from_numpy(x[-1]).double(), -1) for x in (lr, lq))
            kl.append(float((pr.exp() * (pr - pq)).sum()))
            lr, lq = ref.evaluate([t]), q.evaluate([t])  # teacher-forced on the f16 run
        # q8_0 KV is near-lossless, q4_0 visibly lossy but far from random.
        assert agree >= {"q8_0": 28, "q4_0": 16}[kv_type]
        assert np.mean(kl) < {"q8_0": 0.01, "q4_0": 0.5}[kv_type]
    finally:
        ref.close()
        q.close()
