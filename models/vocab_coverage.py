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
    """A predicate telling whether a character can be tokenized, or ``None`` if all can.

    ``token_texts`` is read lazily and only until every byte's token has been seen: byte
    tokens come first in the vocabularies seen so far (ids 0-255 of byte-level BPE, 3-258
    of SentencePiece), so a vocabulary that covers every byte is read for a few hundred
    tokens, not its 150 000 (0.15 s per model on a first load)."""
    if tokenizer_model == "gpt2":
        wanted = {char: b for b, char in enumerate(gpt2_byte_chars())}
    elif tokenizer_model == "llama":
        wanted = {f"<0x{b:02X}>": b for b in range(256)}
    else:
        return None
    texts: set[str] = set()
    for text in token_texts:
        wanted.pop(text, None)
        if not wanted:
            return None
        texts.add(text)
    missing = set(wanted.values())
    if tokenizer_model == "gpt2":
        return lambda ch: not any(b in missing for b in ch.encode("utf-8"))
    return lambda ch: (ch.replace(" ", "▁") in texts) or not any(b in missing for b in ch.encode("utf-8"))
