"""Which characters a GGUF vocabulary can tokenize at all.

llama.cpp assumes every byte has a fallback token; a vocabulary without them (small
BPE vocabularies trained on ASCII text) makes its tokenizer throw a C++ exception that
aborts the whole process. Tandem checks coverage first and maps uncoverable characters
to the unknown token, as Hugging Face tokenizers do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import lru_cache


@lru_cache(maxsize=1)
def gpt2_byte_chars() -> tuple[str, ...]:
    """GPT-2's byte-to-unicode table: the character byte-level BPE uses for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return tuple(chars[b] for b in range(256))


def coverage_check(tokenizer_model: str | None, token_texts: Iterable[str]) -> Callable[[str], bool] | None:
    """A predicate telling whether a character can be tokenized, or ``None`` if all can."""
    texts = set(token_texts)
    if tokenizer_model == "gpt2":
        table = gpt2_byte_chars()
        missing = {b for b in range(256) if table[b] not in texts}
        if not missing:
            return None
        return lambda ch: not any(b in missing for b in ch.encode("utf-8"))
    if tokenizer_model == "llama":
        has_byte = [f"<0x{b:02X}>" in texts for b in range(256)]
        if all(has_byte):
            return None
        return lambda ch: (ch.replace(" ", "▁") in texts) or all(has_byte[b] for b in ch.encode("utf-8"))
    return None
