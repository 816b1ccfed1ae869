"""Which characters a vocabulary can tokenize: read only as far as the byte tokens."""

from __future__ import annotations

from collections.abc import Iterator

from tandem.models.vocab_coverage import coverage_check, gpt2_byte_chars


def _counted(texts: list[str], seen: list[int]) -> Iterator[str]:
    for text in texts:
        seen[0] += 1
        yield text


def test_a_byte_level_vocabulary_with_every_byte_is_read_only_to_its_last_byte_token() -> None:
    texts = [*gpt2_byte_chars(), *(f"word{i}" for i in range(10_000))]
    seen = [0]
    assert coverage_check("gpt2", _counted(texts, seen)) is None
    assert seen[0] == 256


def test_a_byte_level_vocabulary_missing_bytes_covers_exactly_the_others() -> None:
    table = gpt2_byte_chars()
    covers = coverage_check("gpt2", [c for b, c in enumerate(table) if b not in (0xC3, 0xA9)] + ["hello"])
    assert covers is not None
    assert covers("a") and covers(" ")
    assert not covers("é")  # UTF-8 C3 A9


def test_a_sentencepiece_vocabulary_without_byte_tokens_covers_its_own_pieces() -> None:
    covers = coverage_check("llama", ["<unk>", "<s>", "</s>", "▁", "a", "b", "▁the", *(f"<0x{b:02X}>" for b in range(128))])
    assert covers is not None
    assert covers("a") and covers(" ") and covers("z")  # ASCII bytes have byte tokens
    assert not covers("é")
    full = coverage_check("llama", ["<unk>", *(f"<0x{b:02X}>" for b in range(256)), "▁the"])
    assert full is None


def test_other_tokenizers_are_left_to_their_runtime() -> None:
    assert coverage_check("bert", ["a"]) is None
