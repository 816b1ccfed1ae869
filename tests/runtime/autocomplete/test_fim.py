"""Fill-in-the-middle: FIM tokens are read from GGUF metadata and shape the prompt.

No fixture model was trained for FIM, so this checks the plumbing on a copy of
stories260K whose metadata names three of its tokens as the FIM markers: llama.cpp
reports them, Tandem builds a prefix-suffix-middle prompt from them, and autocomplete
and the server's /infill take the FIM path.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

from tandem.runtime.autocomplete.drafts import Autocompleter, build_fim_prompt, supports_fim
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_config import LlamaConfig

FIM_IDS = {"fim_pre_token_id": 3, "fim_suf_token_id": 4, "fim_mid_token_id": 5}


@pytest.fixture(scope="module")
def fim_model(stories260k: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fim") / "stories260K-fim.gguf"
    reader = gguf.GGUFReader(str(stories260k))
    writer = gguf.GGUFWriter(str(out), "llama")
    meta = {f"tokenizer.ggml.{k}": MetadataDetails(gguf.GGUFValueType.UINT32, v) for k, v in FIM_IDS.items()}
    copy_with_new_metadata(reader, writer, meta, [])
    return out


def test_fim_tokens_come_from_gguf_metadata(fim_model: Path, stories260k: Path) -> None:
    with LlamaCppBackend(fim_model, LlamaConfig(n_ctx=256, n_threads=1)) as b:
        s = b.special
        assert (s.fim_prefix, s.fim_suffix, s.fim_middle) == (3, 4, 5)
        assert supports_fim(b)
    with LlamaCppBackend(stories260k, LlamaConfig(n_ctx=256, n_threads=1)) as plain:
        assert not supports_fim(plain)


def test_fim_prompt_is_prefix_suffix_middle(fim_model: Path) -> None:
    with LlamaCppBackend(fim_model, LlamaConfig(n_ctx=256, n_threads=1)) as b:
        pre, suf = b.tokenize("Once upon a time"), b.tokenize(" and they lived happily.")
        prompt = build_fim_prompt(b, "Once upon a time", " and they lived happily.")
        assert prompt == [b.special.bos, 3, *pre, 4, *suf, 5]
        # What is nearest the cursor is kept when the budgets cut.
        cut = build_fim_prompt(b, "Once upon a time", " and they lived happily.", n_prefix_tokens=2, n_suffix_tokens=1)
        assert cut == [b.special.bos, 3, *pre[-2:], 4, suf[0], 5]


def test_autocomplete_uses_the_fim_path(fim_model: Path) -> None:
    with LlamaCppBackend(fim_model, LlamaConfig(n_ctx=256, n_threads=1)) as b:
        auto = Autocompleter(b)
        assert auto.fim
        assert auto.build_prompt("Once upon a time", " The end.")[:2] == [b.special.bos, 3]
