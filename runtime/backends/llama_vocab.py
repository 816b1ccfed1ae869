"""A GGUF model's vocabulary through llama.cpp: the tokenizer half of every GGUF backend.

One class serves the llama.cpp backend (sharing its loaded model), and the torch and
ONNX engines and tokenizer-only uses (a ``vocab_only`` load, no weights), so ids, bytes
and special tokens are identical everywhere. It also guards llama.cpp against text its
vocabulary cannot encode (see :mod:`tandem.models.vocab_coverage`).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Any

import llama_cpp
from llama_cpp import _internals

from tandem.errors import ModelFormatError, TandemError
from tandem.runtime.backends import (
    file_facts,
    llama_log,  # noqa: F401  (installed on import: llama.cpp's log silenced)
)
from tandem.runtime.backends.llama_bindings import byte_coverage, end_of_generation
from tandem.runtime.backends.protocol import SpecialTokens

NO_FD_REDIRECT = True
"""``verbose`` for llama-cpp-python's loaders: ``False`` would point file descriptors 1
and 2 at /dev/null around each load (``suppress_stdout_stderr``, process-wide, while the
server's other threads write), and hide a native crash's report with them. llama.cpp's
log already goes to :func:`tandem.runtime.backends.llama_log.quiet_log`, which silences it;
what is left on stderr is what a user must see (an abort's message)."""


def load_model(path: Path, params: llama_cpp.llama_model_params) -> _internals.LlamaModel:
    """Load a GGUF with explicit model params (``llama_cpp.Llama`` does not expose all of
    them, e.g. ``use_extra_bufts``); a failure is a :class:`ModelFormatError`."""
    try:
        return _internals.LlamaModel(path_model=str(path), params=params, verbose=NO_FD_REDIRECT)
    except (ValueError, RuntimeError) as exc:
        raise ModelFormatError(f"llama.cpp could not load {path}: {exc}") from None


class LlamaVocab:
    def __init__(self, model: _internals.LlamaModel, *, owns: bool = False, path: Path | None = None) -> None:
        """``path``: the file ``model`` was loaded from, whose facts (end-of-generation
        tokens, byte coverage) are then remembered per file version
        (:mod:`tandem.runtime.backends.file_facts`) instead of found again each load."""
        self.model = model
        self._owns = owns
        self._path = path
        self._vocab = model.vocab
        self.metadata: dict[str, str] = model.metadata()
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self._pieces: dict[int, bytes] = {}

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> LlamaVocab:
        """Load only the vocabulary of a GGUF file (no weights, no context)."""
        path = Path(path)
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        try:
            model = _internals.LlamaModel(path_model=str(path), params=params, verbose=NO_FD_REDIRECT)
        except (ValueError, RuntimeError) as exc:
            raise ModelFormatError(f"llama.cpp could not read the vocabulary of {path}: {exc}") from None
        vocab = cls(model, owns=True, path=path)
        vocab.path, vocab.name = path, path.stem
        return vocab

    # -- text <-> ids -------------------------------------------------------------------
    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]:
        covers = self._coverage
        if covers is not None and not all(covers(ch) for ch in set(text)):
            text, special = self._replace_uncovered(text, covers, special)
        return self.model.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special)

    def piece(self, token: int, *, special: bool = False) -> bytes:
        """Raw bytes of one token; with ``special`` control tokens render as their text."""
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[: max(n, 0)]

    def token_bytes(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self.piece(token)
        return piece

    def control_text(self, token: int | None) -> str:
        return "" if token is None else self.piece(token, special=True).decode("utf-8", errors="replace")

    # -- metadata -----------------------------------------------------------------------
    @cached_property
    def special(self) -> SpecialTokens:
        v = self._vocab

        def tok(fn: Callable) -> int | None:
            t = int(fn(v))
            return t if 0 <= t < self.n_vocab else None

        bos, eos = tok(llama_cpp.llama_vocab_bos), tok(llama_cpp.llama_vocab_eos)
        return SpecialTokens(
            bos=bos,
            eos=eos,
            eog=frozenset(self._eog()),
            fim_prefix=tok(llama_cpp.llama_vocab_fim_pre),
            fim_suffix=tok(llama_cpp.llama_vocab_fim_suf),
            fim_middle=tok(llama_cpp.llama_vocab_fim_mid),
            bos_text=self.control_text(bos),
            eos_text=self.control_text(eos),
        )

    def chat_template(self) -> str | None:
        return self.metadata.get("tokenizer.chat_template")

    # -- coverage guard -----------------------------------------------------------------
    @cached_property
    def _coverage(self) -> Callable[[str], bool] | None:
        if self._recall(file_facts.COVERS_EVERY_BYTE) is True:
            return None
        covers = byte_coverage(llama_cpp, self._vocab, self.n_vocab, self.metadata.get("tokenizer.ggml.model"))
        if covers is None:
            self._remember(file_facts.COVERS_EVERY_BYTE, True)
        return covers

    def _eog(self) -> list[int]:
        found = self._recall(file_facts.EOG_TOKENS)
        if isinstance(found, list):
            return found
        found = end_of_generation(llama_cpp, self._vocab, self.n_vocab)
        self._remember(file_facts.EOG_TOKENS, found)
        return found

    def _recall(self, fact: str) -> Any:
        """A fact of this vocabulary's file found on an earlier load, else ``None``."""
        if self._path is None:
            return None

        return file_facts.recall(self._path, fact)

    def _remember(self, fact: str, value: Any) -> None:
        if self._path is not None:
            file_facts.remember(self._path, fact, value)

    def _replace_uncovered(self, text: str, covers: Callable[[str], bool], special: bool) -> tuple[str, bool]:
        """Swap characters the vocabulary cannot encode for its unknown token, as HF does."""
        unk_id = self.metadata.get("tokenizer.ggml.unknown_token_id")
        unk = self.control_text(int(unk_id)) if unk_id is not None else ""
        if not unk:
            bad = "".join(sorted({ch for ch in text if not covers(ch)})[:5])
            raise TandemError(f"This model's vocabulary cannot encode {bad!r} and has no unknown token.")
        if not special:  # literal text that looks like the unknown token must stay literal
            text = text.replace(unk, unk[:-1])
        return "".join(ch if covers(ch) else unk for ch in text), True

    def close(self) -> None:
        if self._owns:
            self.model.close()


class TokenizerDelegate:
    """The tokenizer half of the Backend protocol, delegated to ``self.tokenizer``
    (a :class:`LlamaVocab`, or any object with the same methods)."""

    tokenizer: LlamaVocab

    @property
    def special(self) -> SpecialTokens:
        return self.tokenizer.special

    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]:
        return self.tokenizer.tokenize(text, add_bos=add_bos, special=special)

    def token_bytes(self, token: int) -> bytes:
        return self.tokenizer.token_bytes(token)

    def chat_template(self) -> str | None:
        return self.tokenizer.chat_template()
