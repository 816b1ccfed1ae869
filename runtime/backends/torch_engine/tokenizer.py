"""Tokenizers for the torch and ONNX engines, identical to what llama.cpp would use.

* GGUF models: the GGUF's own vocabulary through llama.cpp loaded ``vocab_only`` (no
  weights, no context), so ids match :class:`LlamaCppBackend` bit for bit.
* Hugging Face folders: ``tokenizer.json`` through the ``tokenizers`` library; token
  bytes come from the vocabulary itself (``▁`` -> space and ``<0xNN>`` byte tokens for
  SentencePiece-style BPE, the GPT-2 byte-to-unicode table for byte-level BPE).
"""

from __future__ import annotations

import json
import os
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Protocol

from tandem.errors import ModelFormatError
from tandem.models.hf_tokenizer import read_json_optional
from tandem.models.vocab_coverage import gpt2_byte_chars
from tandem.runtime.backends.llama_vocab import LlamaVocab
from tandem.runtime.backends.protocol import SpecialTokens


class Tokenizer(Protocol):
    n_vocab: int
    special: SpecialTokens

    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]: ...
    def token_bytes(self, token: int) -> bytes: ...
    def chat_template(self) -> str | None: ...
    def close(self) -> None: ...


@lru_cache(maxsize=1)
def _gpt2_unicode_to_byte() -> dict[str, int]:
    """GPT-2's reversible byte <-> printable-unicode table, inverted."""
    return {c: b for b, c in enumerate(gpt2_byte_chars())}


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (plus ``tokenizer_config.json`` / ``config.json``)."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        from tokenizers import Tokenizer as HFTok  # local: the [torch]/[onnx] extra

        folder = Path(folder)
        file = folder / "tokenizer.json"
        if not file.exists():
            raise ModelFormatError(f"{folder} has no tokenizer.json.")
        self.tok = HFTok.from_file(str(file))
        spec = json.loads(file.read_text(encoding="utf-8"))
        self._byte_level = "ByteLevel" in json.dumps(spec.get("decoder") or {})
        self._added = {a["id"]: a for a in spec.get("added_tokens", [])}
        self.n_vocab = self.tok.get_vocab_size(with_added_tokens=True)
        self._config = read_json_optional(folder / "config.json")
        self._tok_config = read_json_optional(folder / "tokenizer_config.json")
        self._pieces: dict[int, bytes] = {}

    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]:
        # The tokenizers library always matches added-token text, so ``special`` cannot
        # turn that off; ordinary prompts never contain those strings.
        ids = self.tok.encode(text, add_special_tokens=False).ids
        bos = self.special.bos
        if add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return ids

    def token_bytes(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is not None:
            return piece
        added = self._added.get(token)
        text = self.tok.id_to_token(token) or ""
        if added is not None and added.get("special"):
            piece = b""
        elif self._byte_level:
            table = _gpt2_unicode_to_byte()
            piece = bytes(table[c] for c in text) if all(c in table for c in text) else text.encode()
        elif len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            piece = bytes([int(text[3:5], 16)])
        else:
            piece = text.replace("▁", " ").encode("utf-8")
        self._pieces[token] = piece
        return piece

    def _token_id(self, key: str) -> int | None:
        value = self._config.get(f"{key}_token_id")
        if isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, int):
            return value
        name = self._tok_config.get(f"{key}_token")
        if isinstance(name, dict):
            name = name.get("content")
        return self.tok.token_to_id(name) if isinstance(name, str) else None

    @cached_property
    def special(self) -> SpecialTokens:
        bos, eos = self._token_id("bos"), self._token_id("eos")
        eog = {eos} if eos is not None else set()
        for idx, a in self._added.items():
            if a.get("special") and a["content"] in ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|endoftext|>"):
                eog.add(idx)
        return SpecialTokens(
            bos=bos,
            eos=eos,
            eog=frozenset(eog),
            bos_text=self.tok.id_to_token(bos) or "" if bos is not None else "",
            eos_text=self.tok.id_to_token(eos) or "" if eos is not None else "",
        )

    def chat_template(self) -> str | None:
        template = self._tok_config.get("chat_template")
        return template if isinstance(template, str) else None

    def close(self) -> None:
        pass


def load_tokenizer(path: str | os.PathLike[str]) -> LlamaVocab | HFTokenizer:
    return HFTokenizer(path) if Path(path).is_dir() else LlamaVocab.open(path)
