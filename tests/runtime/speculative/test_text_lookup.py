"""Text-level prompt lookup: matches on bytes, drafts as the tokenizer tokenizes, and the
adaptive policy trusts its measured confidence without letting other sources silence it.

The codec here tokenizes into words (a word with its leading space is one token, as BPE
tokenizers do), so a value quoted in JSON starts with another token than in the prompt.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.speculative.cost import CostCurve
from tandem.runtime.speculative.drafters.lookup import PromptLookupDrafter
from tandem.runtime.speculative.drafters.text_lookup import (
    CONFIDENCE,
    TextLookupDrafter,
    clause_head,
    longest_earlier_match,
)
from tandem.runtime.speculative.policy.adaptive import AdaptivePolicy
from tandem.runtime.speculative.policy.adaptive_config import AdaptiveConfig

GREEDY = Sampler(SamplingParams.greedy_params())


class WordCodec:
    """Tokens are words with their leading space, or single punctuation marks."""

    def __init__(self) -> None:
        self.vocab: list[bytes] = []
        self.ids: dict[bytes, int] = {}

    def id(self, piece: bytes) -> int:
        if piece not in self.ids:
            self.ids[piece] = len(self.vocab)
            self.vocab.append(piece)
        return self.ids[piece]

    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]:
        return [self.id(p.encode()) for p in re.findall(r" ?[A-Za-z0-9@]+| ?[^A-Za-z0-9@ ]| ", text)]

    def token_bytes(self, token: int) -> bytes:
        return self.vocab[token]

    def text(self, tokens: list[int]) -> str:
        return b"".join(self.vocab[t] for t in tokens).decode()


PROMPT = "Extract: Priya Raman, 41, lives in Lyon, France. She works at Voltaire Analytics in town.\n"


def reference_match(text: bytes, lo: int, hi: int) -> tuple[int, int] | None:
    """Brute force: every suffix length, every earlier start; the longest, then the latest."""
    best = None
    for n in range(lo, min(hi, len(text) - 1) + 1):
        ends = [s + n for s in range(len(text) - n) if text[s:s + n] == text[-n:] and s + n < len(text)]
        if ends:
            best = (n, max(ends))
    return best


@pytest.mark.parametrize("seed", range(8))
def test_the_longest_earlier_match_is_found_as_brute_force_finds_it(seed: int) -> None:
    rng = np.random.default_rng(seed)
    text = bytes(rng.choice(list(b"ab c"), 80).tolist())
    for end in range(2, len(text) + 1):
        assert longest_earlier_match(text[:end], 2, 12) == reference_match(text[:end], 2, 12)


def test_a_clause_ends_at_punctuation_before_a_space_not_inside_a_number_or_an_address() -> None:
    assert clause_head(b" Raman, 41, lives") == b" Raman"
    assert clause_head(b" Vogel (anna@x.org)") == b" Vogel"
    assert clause_head(b".50 EUR each. Then") == b".50 EUR each"
    assert clause_head(b"@rustberlin.org) and") == b"@rustberlin.org"


def test_a_value_quoted_in_json_is_continued_from_the_prompt_where_token_lookup_finds_nothing() -> None:
    codec = WordCodec()
    context = codec.tokenize(PROMPT + '{"employer": "Voltaire')
    tokens = TextLookupDrafter(codec).propose(context, 8, GREEDY)
    assert codec.text(tokens.tokens) == " Analytics in town"  # the clause, up to its full stop
    assert tokens.source == "text-lookup" and tokens.confidence is not None
    assert tokens.confidence[0] == pytest.approx(CONFIDENCE) and tokens.confidence == sorted(tokens.confidence, reverse=True)
    assert PromptLookupDrafter().propose(context, 8, GREEDY).tokens == []  # '"Voltaire' is not ' Voltaire'


def test_it_drafts_nothing_between_words_nor_where_the_clause_ends() -> None:
    codec = WordCodec()
    drafter = TextLookupDrafter(codec)
    assert drafter.propose(codec.tokenize(PROMPT + '{"city": "'), 8, GREEDY).tokens == []  # the reply's choice
    assert drafter.propose(codec.tokenize(PROMPT + '{"city": "Lyon'), 8, GREEDY).tokens == []  # ", France" follows
    assert codec.text(drafter.propose(codec.tokenize(PROMPT + '{"name": "Priya'), 1, GREEDY).tokens) == " Raman"


def test_a_context_that_changes_underneath_is_read_again() -> None:
    codec = WordCodec()
    drafter = TextLookupDrafter(codec)
    drafter.propose(codec.tokenize(PROMPT + '{"employer": "Voltaire'), 8, GREEDY)
    other = codec.tokenize("Order A-20931 from Jonas Berg was shipped.\n" + '{"customer": "Jonas')
    assert codec.text(drafter.propose(other, 8, GREEDY).tokens) == " Berg was shipped"


def _policy(measured: frozenset[str]) -> AdaptivePolicy:
    # c(k) of a repacked 1.5B at 2 threads (verify chunks of 3): 2 drafts cost 1.99 steps.
    curve = CostCurve((1.0, 1.63, 1.99, 2.99, 3.62, 3.98, 4.98, 5.61, 5.97), 0.065)
    return AdaptivePolicy(curve, AdaptiveConfig(max_len=8), cheap_drafter=True, measured_sources=measured)


def test_a_measured_source_is_verified_from_its_first_draft_and_outlives_one_rejection() -> None:
    confidence = [CONFIDENCE, CONFIDENCE * 0.93]
    heuristic = _policy(frozenset())
    assert heuristic.trim(confidence, 2, "text-lookup") == 0  # believed at c**3: not worth a probe
    measured = _policy(frozenset({"text-lookup"}))
    assert measured.trim(confidence, 2, "text-lookup") == 2
    measured.observe(2, 0, 0.0, 0.0, 0.0, "text-lookup", timed=False)  # rejected at its first token
    assert measured.trim(confidence, 2, "text-lookup") == 2  # prior of TRUST_AFTER tokens: still trusted


def test_other_sources_rejections_do_not_judge_a_measured_source() -> None:
    policy = _policy(frozenset({"text-lookup"}))
    assert policy.trim([0.999, 0.999], 2, "suffix") > 0  # a sure match of the suffix tree: probed
    policy.observe(2, 0, 0.0, 0.0, 0.0, "suffix", timed=False)  # and rejected
    assert policy.trim([0.999, 0.999], 2, "lookup") == 0  # prompt lookup is judged by that verdict
    assert policy.trim([CONFIDENCE, CONFIDENCE * 0.93], 2, "text-lookup") == 2  # text lookup is not
