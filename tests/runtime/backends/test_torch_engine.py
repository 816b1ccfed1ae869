"""The torch engine against llama.cpp on the fixture models, plus its own exactness rules.

llama.cpp runs with an f32 KV cache here, so both sides compute in float32 and the only
differences are summation order: logits agree to ``LOGIT_TOL`` (measured ~1e-5 on
logits of magnitude ~20) and greedy tokens are identical.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from greedy_runs import greedy_rows

from tandem.errors import ModelFormatError, ModelNotFound
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_config import LlamaConfig
from tandem.runtime.backends.torch_engine.backend import TorchBackend, TorchConfig, tree_mask
from tandem.runtime.backends.torch_engine.cache import KVCache
from tandem.runtime.backends.torch_engine.loader import unpermute_rope

LOGIT_TOL = 1e-3
PROMPTS = [
    "Once upon a time",
    "The little dog",
    "Lily and Ben went to the park. They",
    "One day, a big red ball",
    "Tom was sad because",
    "The sun was shining and the birds",
    "Mom said",
    "There was a cat who liked to",
]


def assert_matches_llama(torch_be: TorchBackend, llama_be: LlamaCppBackend, n_tokens: int = 24) -> None:
    worst = 0.0
    for text in PROMPTS:
        ids = llama_be.tokenize(text, add_bos=True)
        assert torch_be.tokenize(text, add_bos=True) == ids
        ours, our_rows = greedy_rows(torch_be, ids, n_tokens)
        ref, ref_rows = greedy_rows(llama_be, ids, n_tokens)
        assert ours == ref, text
        worst = max(worst, max(float(np.abs(a - b).max()) for a, b in zip(our_rows, ref_rows, strict=True)))
    assert worst < LOGIT_TOL


@pytest.fixture(scope="module")
def stories_torch(stories260k: Path):
    backend = TorchBackend(stories260k, TorchConfig(device="cpu", n_ctx=512))
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def stories_llama(stories260k: Path):
    backend = LlamaCppBackend(stories260k, LlamaConfig(n_ctx=512, type_k="f32", type_v="f32"))
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def tinystories_gguf(tinystories656k_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 656K checkpoint converted to GGUF by the project's converter (for llama.cpp)."""
    from tandem.models.convert import ensure_converted

    return ensure_converted(tinystories656k_dir, tmp_path_factory.mktemp("converted"), "f32")


def test_stories260k_gguf_matches_llama_cpp(stories_torch, stories_llama) -> None:
    assert_matches_llama(stories_torch, stories_llama)


def test_tinystories_safetensors_matches_llama_cpp_on_converted_gguf(tinystories656k_dir, tinystories_gguf) -> None:
    torch_be = TorchBackend(tinystories656k_dir, TorchConfig(device="cpu", n_ctx=512))
    llama_be = LlamaCppBackend(tinystories_gguf, LlamaConfig(n_ctx=512, type_k="f32", type_v="f32"))
    try:
        assert torch_be.n_vocab == llama_be.n_vocab == 2048
        assert_matches_llama(torch_be, llama_be)
        text = "Once upon a time, there was a bird."
        ids = torch_be.tokenize(text)
        assert b"".join(torch_be.token_bytes(t) for t in ids) == b"".join(llama_be.token_bytes(t) for t in ids)
    finally:
        torch_be.close()
        llama_be.close()


def test_converted_gguf_loads_same_weights_as_safetensors(tinystories656k_dir, tinystories_gguf) -> None:
    """The GGUF path (un-permuted Q/K) and the safetensors path give the same logits."""
    a = TorchBackend(tinystories656k_dir, TorchConfig(device="cpu"))
    b = TorchBackend(tinystories_gguf, TorchConfig(device="cpu"))
    ids = a.tokenize("The cat sat on the mat and", add_bos=True)
    np.testing.assert_allclose(a.evaluate(ids, range(len(ids))), b.evaluate(ids, range(len(ids))), atol=1e-5)


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    rng = np.random.default_rng(0)
    n_head, head_dim, dim = 4, 8, 6
    hf = rng.standard_normal((n_head * head_dim, dim))
    # convert_hf_to_gguf.LlamaModel.permute, written out independently
    gguf_layout = hf.reshape(n_head, 2, head_dim // 2, dim).swapaxes(1, 2).reshape(hf.shape)
    np.testing.assert_array_equal(unpermute_rope(gguf_layout, n_head, head_dim), hf)


def test_batched_rows_match_one_at_a_time(stories260k) -> None:
    backend = TorchBackend(stories260k, TorchConfig(device="cpu", dtype="float64"))
    ids = backend.tokenize("Lily and Ben went to the park. They played", add_bos=True)
    batched = backend.evaluate(ids, [0, 3, len(ids) - 1])
    backend.truncate(0)
    single = np.stack([backend.evaluate([t])[-1] for t in ids])
    np.testing.assert_allclose(batched, single[[0, 3, len(ids) - 1]], atol=1e-5)
    assert backend.tokens == ids


def test_truncate_then_reevaluate_is_exact(stories_torch) -> None:
    ids = stories_torch.tokenize("Once upon a time there was", add_bos=True)
    stories_torch.truncate(0)
    stories_torch.evaluate(ids)
    first = stories_torch.evaluate([300, 301, 302, 303], range(4))
    for _ in range(3):
        stories_torch.evaluate([10, 11, 12])  # a rejected draft
        stories_torch.truncate(len(ids))
        again = stories_torch.evaluate([300, 301, 302, 303], range(4))
        np.testing.assert_array_equal(first, again)
        stories_torch.truncate(len(ids))
    assert stories_torch.tokens == ids and len(stories_torch.cache) == len(ids)


def test_chunked_prefill_equals_single_pass(stories260k) -> None:
    a = TorchBackend(stories260k, TorchConfig(device="cpu", dtype="float64", n_batch=4))
    b = TorchBackend(stories260k, TorchConfig(device="cpu", dtype="float64", n_batch=512))
    ids = a.tokenize("The sun was shining and the birds were singing in the tall trees", add_bos=True)
    np.testing.assert_allclose(a.evaluate(ids, range(len(ids))), b.evaluate(ids, range(len(ids))), atol=1e-5)


def test_inputs_embeds_equal_token_ids(stories_torch) -> None:
    ids = stories_torch.tokenize("The little dog", add_bos=True)
    stories_torch.truncate(0)
    by_id = stories_torch.evaluate(ids, range(len(ids)))
    stories_torch.truncate(0)
    embeds = stories_torch.token_embeddings()[ids]
    by_embed = stories_torch.evaluate_embeddings(embeds, range(len(ids)))
    np.testing.assert_array_equal(by_id, by_embed)
    assert stories_torch.tokens == [-1] * len(ids)


def test_tree_mask_is_ancestors_only() -> None:
    parents = [-1, 0, 0, 1, -1, 4]
    mask = tree_mask(parents).numpy()
    expected = np.zeros((6, 6), dtype=bool)
    for i in range(6):
        j = i
        while j >= 0:  # walk up independently of the implementation
            expected[i, j] = True
            j = parents[j]
    np.testing.assert_array_equal(mask, expected)
    with pytest.raises(ValueError):
        tree_mask([1, -1])


def test_tree_logits_equal_each_branch_alone(stories260k) -> None:
    backend = TorchBackend(stories260k, TorchConfig(device="cpu", dtype="float64"))
    prompt = backend.tokenize("Once upon a time", add_bos=True)
    # Two roots; root 0 has children 1 and 2; node 3 under 1; node 5 under root 4.
    tokens = [261, 300, 301, 302, 400, 401]
    parents = [-1, 0, 0, 1, -1, 4]
    backend.evaluate(prompt)
    tree = backend.evaluate_tree(tokens, parents)
    assert backend.tokens == prompt + tokens
    branches = {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [4], 5: [4, 5]}
    for node, path in branches.items():
        backend.truncate(len(prompt))
        alone = backend.evaluate([tokens[i] for i in path])[-1]
        np.testing.assert_allclose(tree[node], alone, atol=1e-10)
    # Accepting a branch leaves the cache as if the branch had been evaluated plainly.
    backend.truncate(len(prompt))
    backend.evaluate_tree(tokens, parents)
    backend.accept_path([0, 1, 3])
    assert backend.tokens == prompt + [261, 300, 302]
    after_tree = backend.evaluate([5])[-1]
    backend.truncate(len(prompt))
    backend.evaluate([261, 300, 302])
    np.testing.assert_allclose(after_tree, backend.evaluate([5])[-1], atol=1e-10)
    with pytest.raises(ValueError):
        backend.accept_path([0])  # only right after evaluate_tree


def test_custom_cache_plugs_in(stories260k) -> None:
    """A subclass that watches attention sees probabilities that sum to one per query."""

    class Watching(KVCache):
        wants_attention = True

        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            self.seen: list[tuple[int, tuple[int, ...]]] = []

        def observe_attention(self, layer: int, probs: torch.Tensor) -> None:
            torch.testing.assert_close(probs.sum(-1), torch.ones_like(probs.sum(-1)))
            self.seen.append((layer, tuple(probs.shape)))

    def factory(cfg, dtype, device):
        return Watching(cfg.n_layer, cfg.n_head_kv, cfg.head_dim, dtype=dtype, device=device)

    plain = TorchBackend(stories260k, TorchConfig(device="cpu"))
    watched = TorchBackend(stories260k, TorchConfig(device="cpu", cache_factory=factory))
    ids = plain.tokenize("Mom said", add_bos=True)
    np.testing.assert_allclose(plain.evaluate(ids), watched.evaluate(ids), atol=1e-5)
    assert watched.cache.seen[0] == (0, (8, len(ids), len(ids)))
    assert len(watched.cache.seen) == watched.model_config.n_layer


def test_memory_report_and_errors(stories_torch, tmp_path, vocab_gguf) -> None:
    mem = stories_torch.memory()
    assert mem.weights == sum(4 * int(np.prod(t.shape)) for t in gguf.GGUFReader(str(stories_torch.path)).tensors)
    assert mem.kv_cache > 0 and mem.device == "cpu"
    with pytest.raises(ModelNotFound):
        TorchBackend(tmp_path / "missing.gguf")
    with pytest.raises(ModelFormatError):
        TorchBackend(vocab_gguf / "ggml-vocab-llama-spm.gguf")


def write_random_moe_gguf(path: Path, vocab_src: Path, arch: str, seed: int = 0) -> None:
    """A small random-weight MoE in llama.cpp's layout, with the stories260K vocabulary.

    Random weights are fine here: the test compares two implementations of the same
    function (llama.cpp's MoE graph and ours), not output quality.
    """
    rng = np.random.default_rng(seed)
    src = gguf.GGUFReader(str(vocab_src))
    tokens = [bytes(src.fields["tokenizer.ggml.tokens"].parts[i]) for i in src.fields["tokenizer.ggml.tokens"].data]
    vocab, dim, n_head, n_kv, ff, n_exp, used, layers = len(tokens), 64, 8, 4, 96, 4, 2, 2
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(256)
    w.add_embedding_length(dim)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_expert_count(n_exp)
    w.add_expert_used_count(used)
    w.add_expert_feed_forward_length(ff)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(ff)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(src.fields["tokenizer.ggml.scores"].contents())
    w.add_token_types(src.fields["tokenizer.ggml.token_type"].contents())
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def rand(*shape: int, scale: float = 0.3) -> np.ndarray:
        return (rng.standard_normal(shape) * scale / np.sqrt(shape[-1]) * 4).astype(np.float32)

    w.add_tensor("token_embd.weight", rand(vocab, dim, scale=2.0))
    w.add_tensor("output_norm.weight", np.ones(dim, np.float32))
    w.add_tensor("output.weight", rand(vocab, dim))
    hd = dim // n_head
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(dim, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(dim, np.float32))
        w.add_tensor(p + "attn_q.weight", rand(n_head * hd, dim))
        w.add_tensor(p + "attn_k.weight", rand(n_kv * hd, dim))
        w.add_tensor(p + "attn_v.weight", rand(n_kv * hd, dim))
        w.add_tensor(p + "attn_output.weight", rand(dim, n_head * hd))
        w.add_tensor(p + "ffn_gate_inp.weight", rand(n_exp, dim, scale=2.0))
        w.add_tensor(p + "ffn_gate_exps.weight", rand(n_exp, ff, dim, scale=1.0))
        w.add_tensor(p + "ffn_up_exps.weight", rand(n_exp, ff, dim, scale=1.0))
        w.add_tensor(p + "ffn_down_exps.weight", rand(n_exp, dim, ff, scale=1.0))
        if arch == "qwen2moe":
            for name, rows in (("attn_q", n_head * hd), ("attn_k", n_kv * hd), ("attn_v", n_kv * hd)):
                w.add_tensor(p + f"{name}.bias", rand(rows, 1)[:, 0])
            w.add_tensor(p + "ffn_gate_inp_shexp.weight", rand(1, dim)[0])
            w.add_tensor(p + "ffn_gate_shexp.weight", rand(ff, dim))
            w.add_tensor(p + "ffn_up_shexp.weight", rand(ff, dim))
            w.add_tensor(p + "ffn_down_shexp.weight", rand(dim, ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2moe"])
def test_moe_layout_matches_llama_cpp(arch: str, stories260k: Path, tmp_path: Path) -> None:
    """Mixtral-style (llama arch, renormalised top-k) and Qwen2-MoE (shared expert, biases)."""
    path = tmp_path / f"moe-{arch}.gguf"
    write_random_moe_gguf(path, stories260k, arch)
    torch_be = TorchBackend(path, TorchConfig(device="cpu", n_ctx=256))
    llama_be = LlamaCppBackend(path, LlamaConfig(n_ctx=256, type_k="f32", type_v="f32"))
    try:
        assert torch_be.model_config.n_experts == 4
        for text in PROMPTS[:4]:
            ids = llama_be.tokenize(text, add_bos=True)
            ours, our_rows = greedy_rows(torch_be, ids, 12)
            ref, ref_rows = greedy_rows(llama_be, ids, 12)
            assert ours == ref
            for a, b in zip(our_rows, ref_rows, strict=True):
                # measured ~4e-6; renormalising (or not) the top-k weights moves logits
                # by 1e-2..1e-1 on these weights, so 1e-4 tells the routing rules apart
                np.testing.assert_allclose(a, b, atol=1e-4)
    finally:
        torch_be.close()
        llama_be.close()
