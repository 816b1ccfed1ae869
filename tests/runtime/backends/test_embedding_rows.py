"""Superposition reads only the embedding rows it mixes (runtime/backends/embedding_rows.py):
the same rows as the whole dequantized table, without ever building that table."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.runtime.autocomplete.superposed import SuperposedDecoder
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_config import LlamaConfig


def test_rows_equal_the_whole_table(stories_backend) -> None:
    table = stories_backend.token_embeddings()
    ids = [0, 5, 511, 5, 17]
    np.testing.assert_array_equal(stories_backend.token_embedding_rows(ids), table[ids])


def test_qwen_superposition_never_loads_the_table(real_models, monkeypatch: pytest.MonkeyPatch) -> None:
    with LlamaCppBackend(real_models.qwen_05b, LlamaConfig(n_ctx=512, n_threads=2)) as qwen:
        def whole_table():
            raise AssertionError("the whole embedding table was loaded")

        monkeypatch.setattr(qwen, "token_embeddings", whole_table)
        decoder = SuperposedDecoder(qwen)
        prompt = qwen.tokenize("def add(a, b):\n    return", add_bos=False)
        result = decoder.decode(prompt, k=3, max_tokens=4, stop_at_eog=False)
        assert len(result.drafts) == 3 and result.steps == 4
        rows = qwen._embd_rows
        assert 0 < rows.cached_bytes <= 3 * 3 * qwen.n_embd * 4  # at most k rows per mixed step
        # the rows are the model's own: embedding input of a token reproduces token input
        tok = qwen.tokenize(" hello", add_bos=False)
        qwen.truncate(0)
        qwen.evaluate(prompt)
        by_token = qwen.evaluate(tok)[-1]
        qwen.truncate(len(prompt))
        by_row = qwen.evaluate_embeddings(qwen.token_embedding_rows(tok))[-1]
        assert int(np.argmax(by_row)) == int(np.argmax(by_token))
        np.testing.assert_allclose(by_row, by_token, atol=1e-3)
