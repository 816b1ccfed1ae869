"""The llama.cpp backend honours the Backend protocol exactly."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.errors import PromptError
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_config import LlamaConfig
from tandem.runtime.backends.protocol import Backend, prefill

PROMPT = "Once upon a time, there was a little dog"


def test_implements_protocol(stories_backend: LlamaCppBackend) -> None:
    assert isinstance(stories_backend, Backend)
    assert stories_backend.n_vocab == 512
    assert stories_backend.special.bos == 1 and 2 in stories_backend.special.eog


def test_logits_for_selected_rows_match_stepwise(stories_backend: LlamaCppBackend) -> None:
    b = stories_backend
    ids = b.tokenize(PROMPT, add_bos=True)
    batched = b.evaluate(ids, logits_for=range(len(ids)))
    assert batched.shape == (len(ids), b.n_vocab)
    b.truncate(0)
    step = np.stack([b.evaluate([t])[0] for t in ids])
    np.testing.assert_allclose(batched, step, atol=1e-4)
    assert np.array_equal(batched.argmax(-1), step.argmax(-1))
    b.truncate(0)
    some = b.evaluate(ids, logits_for=[3, 1, 3])  # any order, repeats allowed
    np.testing.assert_allclose(some, batched[[3, 1, 3]], atol=1e-4)
    b.truncate(0)
    with pytest.raises(ValueError, match="logits_for"):  # not rows of uninitialised memory
        b.evaluate(ids, logits_for=[len(ids)])


def test_truncate_rolls_back_exactly(stories_backend: LlamaCppBackend) -> None:
    b = stories_backend
    ids = b.tokenize(PROMPT, add_bos=True)
    first = b.evaluate(ids)
    b.evaluate([5, 6, 7])
    assert len(b.tokens) == len(ids) + 3
    b.truncate(len(ids) - 1)
    assert b.tokens == ids[:-1]
    again = b.evaluate(ids[-1:])
    np.testing.assert_allclose(first, again, atol=1e-5)


def test_prefill_reuses_cached_prefix(stories_backend: LlamaCppBackend) -> None:
    b = stories_backend
    ids = b.tokenize(PROMPT, add_bos=True)
    full = prefill(b, ids)
    more = ids + b.tokenize(" named Max", add_bos=False)
    extended = prefill(b, more)
    assert b.tokens == more
    b.truncate(0)
    np.testing.assert_allclose(prefill(b, more), extended, atol=1e-4)
    assert full.shape == (b.n_vocab,)


def test_context_full_is_a_clear_error(stories260k) -> None:
    with LlamaCppBackend(stories260k, LlamaConfig(n_ctx=32)) as b:
        fill = [3 + i % 500 for i in range(b.n_ctx - 3)]  # llama.cpp may round n_ctx up
        b.evaluate(fill)
        with pytest.raises(PromptError, match="Context full"):
            b.evaluate(list(range(3, 10)))
        assert b.tokens == fill, "a failed evaluate must not change the cache"


def test_token_bytes_reassemble_detokenized_text(stories_backend: LlamaCppBackend) -> None:
    b = stories_backend
    text = "there was a girl named Lily. She said: \"Hi!\" 🐱"
    ids = b.tokenize(text, add_bos=False)
    # SentencePiece adds a space before the text (add_space_prefix), nothing else.
    assert b"".join(b.token_bytes(t) for t in ids).decode() == " " + text
    assert b.token_bytes(b.special.bos) == b""


def test_memory_report_counts_weights_and_kv(stories_backend: LlamaCppBackend) -> None:
    m = stories_backend.memory()
    size = stories_backend.path.stat().st_size
    assert 0.9 * size < m.weights <= size
    # 5 layers x 4 KV heads x 8 dims x (K + V) x 2 bytes (f16) per token
    assert m.kv_cache == 5 * 4 * 8 * 2 * 2 * stories_backend.n_ctx


@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
def test_quantized_kv_needs_whole_blocks_per_head(stories260k, kv: str) -> None:
    from tandem.errors import UnsupportedModel

    with pytest.raises(UnsupportedModel, match="heads have 8"):
        LlamaCppBackend(stories260k, LlamaConfig(n_ctx=256, type_k=kv, type_v=kv))


def test_characters_outside_a_byteless_vocabulary_become_unknown(tinystories656k_gguf) -> None:
    """llama.cpp aborts the process on such text; Tandem maps it to <unk> like HF does."""
    with LlamaCppBackend(tinystories656k_gguf, LlamaConfig(n_ctx=256, n_threads=1)) as b:
        unk = int(b.tokenizer.metadata["tokenizer.ggml.unknown_token_id"])
        ids = b.tokenize("hello (world) é\tdone", add_bos=True)
        assert ids.count(unk) == 4
        text = b"".join(b.token_bytes(t) for t in ids).decode()
        assert "hello" in text and "world" in text and "done" in text
        assert b.tokenize("Once upon a time") == b.tokenize("Once upon a time"), "covered text is untouched"
        assert unk not in b.tokenize("Once upon a time")


CELL_METADATA = 12
"""Bytes llama.cpp's sequence state adds per cached token beside K and V: its position,
its count of sequence ids and the one id."""


@pytest.mark.parametrize("kv", ["f16", "q8_0", "f32"])
def test_kv_bytes_per_token_is_what_llama_cpp_stores(real_models, kv: str) -> None:
    """The one KV-bytes rule (``DecoderShape.kv_bytes_per_token``, which the backend's
    memory report, the planner and ``/v1/models`` use) against llama.cpp's own state:
    each further cached token grows the saved sequence by K, V and its cell metadata."""
    import llama_cpp

    backend = LlamaCppBackend(real_models.qwen_05b, LlamaConfig(n_ctx=256, type_k=kv, type_v=kv,
                                                                flash_attn=kv == "q8_0", exact=kv != "q8_0"))
    try:
        sizes = []
        for n in (10, 50):
            backend.truncate(0)
            backend.evaluate(list(range(100, 100 + n)))
            sizes.append(llama_cpp.llama_state_seq_get_size(backend._ctx, 0))
        assert (sizes[1] - sizes[0]) / 40 == backend.shape.kv_bytes_per_token(kv, kv) + CELL_METADATA
        assert backend.memory().kv_cache == backend.shape.kv_bytes_per_token(kv, kv) * backend.n_ctx
    finally:
        backend.close()
