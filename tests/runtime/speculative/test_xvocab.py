"""Cross-vocabulary drafting: pure mapping, exact TLI sampling, OmniDraft cache, real pairs.

* Pure parts (:mod:`tandem.kernels.vocab_map`) on hand-made vocabularies.
* TLI is exactly lossless under sampling: 4x10^5 single-position trials with partly
  overlapping toy vocabularies (batched acceptance kernel), and whole sequences through
  :class:`CrossVocabDrafter` + the speculative strategy on toy Markov models.
* Real tokenizers (Llama SPM, GPT-2, StarCoder, Phi-3 vocab-only GGUFs): fuzzing with
  hypothesis that every learnt cache entry spells the same bytes on both sides and that
  translation never invents text.
* Greedy identity on the real cross-vocabulary pair stories260K <-> tinystories-656k.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from toy_models import (
    PURE,
    check_matches,
    exact_joint,
    model_distribution,
    random_table,
    sequence_counts,
)
from toy_vocab import DRAFT_PIECES, TARGET_PIECES, PieceToy

from tandem.kernels.acceptance import inverse_cdf, speculative_step
from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.kernels.vocab_map import (
    UNMAPPED,
    aligned_spans,
    build_direct_map,
    byte_offsets,
    intersection_mask,
    restrict_logits,
    scatter_to_target,
    translate,
)
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_config import LlamaConfig
from tandem.runtime.generate import generate
from tandem.runtime.speculative.drafters.xvocab.drafter import CrossVocabDrafter, XVocabConfig
from tandem.runtime.speculative.drafters.xvocab.translation_cache import NGramCache
from tandem.runtime.speculative.loop import speculative
from tandem.runtime.speculative.policy.base import FixedLength

"""Partly overlapping: the drafter lacks d/cd (its tokenizer spells unknown bytes '?'),
the target lacks e/ba/?; the drafter has 'a' twice."""


# -- pure mapping --------------------------------------------------------------------------
def test_direct_map_uses_bytes_priority_and_specials() -> None:
    direct = build_direct_map([b"", b" the", b"x", b"\n", b"zz"], [b"", b"\n", b" the", b"x", b"x"], special_pairs=[(0, 0)])
    # identical bytes map; among target duplicates the higher id (ordinary token) wins
    assert direct.tolist() == [0, 2, 4, 1, UNMAPPED]
    prio = [0, 0, 0, 5, 1]
    assert build_direct_map([b"x"], [b"", b"\n", b" the", b"x", b"x"], target_priority=prio).tolist() == [3]


def test_scatter_sums_drafter_duplicates_and_drops_unmapped() -> None:
    direct = build_direct_map(DRAFT_PIECES, TARGET_PIECES)
    q = np.arange(1, 9, dtype=np.float64)
    q /= q.sum()
    out = scatter_to_target(q, direct, len(TARGET_PIECES))
    assert out[0] == pytest.approx(q[0] + q[6])  # both drafter 'a's
    assert out[4] == out[5] == 0.0
    assert out.sum() == pytest.approx(1.0 - q[2] - q[4] - q[7])  # e, ba, ? have no target id


def test_translate_longest_match_then_direct_then_stop() -> None:
    direct = build_direct_map(DRAFT_PIECES, TARGET_PIECES)
    cache = NGramCache()
    cache.add([0, 1], [3])  # a b -> ab
    tr = translate([0, 1, 5, 1, 2, 0], [0.5, 0.5, 0.9, 0.8, 0.1, 0.3], direct, cache.longest_match)
    assert tr.tokens == [3, 2, 1]  # ab, c, b; stops at 'e'
    assert tr.q_tokens == [0.25, 0.9, 0.8]
    assert tr.consumed == 4 and tr.cache_hits == 1
    assert translate([2, 0], [1, 1], direct).tokens == []
    assert translate([0, 1, 5], [1, 1, 1], direct, max_tokens=2).tokens == [0, 1]


def test_aligned_spans_cut_where_both_tokenizations_cut() -> None:
    d = byte_offsets([b"ab", b"c", b"de", b"f"])  # ab|c|de|f
    t = byte_offsets([b"a", b"bc", b"d", b"ef"])  # a|bc|d|ef
    spans = aligned_spans(d, t)
    assert spans == [((0, 2), (0, 2)), ((2, 4), (2, 4))]


# -- TLI: exactly lossless under sampling -----------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1])
def test_tli_single_position_is_exact(seed: int) -> None:
    """d ~ drafter restricted to the shared vocab, propose direct[d] with the scattered q;
    the emitted token follows p exactly (p also lives on target-only ids)."""
    rng = np.random.default_rng(seed)
    n = 400_000
    direct = build_direct_map(DRAFT_PIECES, TARGET_PIECES)
    logits = rng.normal(size=len(DRAFT_PIECES)) * 2
    q_d = Sampler(PURE).distribution(restrict_logits(logits, intersection_mask(direct)))
    assert q_d[2] == q_d[4] == q_d[7] == 0.0
    q_t = scatter_to_target(q_d, direct, len(TARGET_PIECES))
    assert q_t.sum() == pytest.approx(1.0)
    p = rng.dirichlet(np.ones(len(TARGET_PIECES)))
    p[1] = 0.0  # q > 0 where p = 0
    p /= p.sum()
    d = inverse_cdf(np.broadcast_to(q_d, (n, len(q_d))), rng.random(n))
    x = direct[d]
    P = np.broadcast_to(p, (n, len(p)))
    Q = np.broadcast_to(q_t, (n, len(p)))
    _, token = speculative_step(P, Q, x, rng.random(n), rng.random(n))
    check_matches(np.bincount(token, minlength=len(p)), p, tv_bound=0.006)




@pytest.mark.parametrize("k", [1, 3])
def test_tli_sequences_follow_the_target_exactly(k: int) -> None:
    """Whole 2-token continuations (36 outcomes) through CrossVocabDrafter + the speculative strategy."""
    rng = np.random.default_rng(7 + k)
    target = PieceToy(random_table(len(TARGET_PIECES), rng, zeros=0.2), TARGET_PIECES, "t")
    drafter = PieceToy(random_table(len(DRAFT_PIECES), rng), DRAFT_PIECES, "d")
    x = CrossVocabDrafter(drafter, target, XVocabConfig(mode="tli", persist=False))
    strategy = speculative(x, FixedLength(k))
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0))
    sampler.rng = np.random.default_rng(k)  # unkeyed draws (a seed keys each position: one outcome)
    length = 2
    counts = sequence_counts(strategy, target, sampler, [0], length, 8_000)
    joint = exact_joint(model_distribution(target), 0, length)
    keys = sorted(set(joint) | set(counts))
    check_matches(np.array([counts.get(s, 0) for s in keys]), np.array([joint.get(s, 0.0) for s in keys]), 0.045)
    assert x.stats.proposed > 0 and x.stats.accepted > 0


# -- real tokenizers ------------------------------------------------------------------------------
PAIRS = [("llama-spm", "gpt-2"), ("gpt-2", "starcoder"), ("phi-3", "llama-spm"), ("starcoder", "phi-3")]


@pytest.fixture(scope="module")
def tokenizers(vocab_gguf: Path):
    from tandem.runtime.backends.llama_vocab import LlamaVocab

    toks = {name: LlamaVocab.open(vocab_gguf / f"ggml-vocab-{name}.gguf") for name in {n for p in PAIRS for n in p}}
    yield toks
    for t in toks.values():
        t.close()


@pytest.fixture(scope="module")
def learners(tokenizers):
    """Tokenizer-only drafters (learning and translation need no weights)."""
    return {pair: CrossVocabDrafter(tokenizers[pair[0]], tokenizers[pair[1]], XVocabConfig(persist=False),
                                    owns_backend=False) for pair in PAIRS}


TEXT = st.lists(
    st.one_of(
        st.sampled_from(list("abcdefghij klmnop \n\t  XYZ.,;:()[]{}<>=+-*/_#\"'0123456789")),
        st.sampled_from(["the ", "def ", "return ", "    ", "\n\n", "ing", "tion", " flake", "stamps"]),
        st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")),
    ),
    min_size=1,
    max_size=40,
).map("".join)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT, draft_text=TEXT)
@pytest.mark.parametrize("pair", PAIRS)
def test_cache_entries_spell_the_same_text_and_translation_never_invents(
    learners, tokenizers, pair, text: str, draft_text: str
) -> None:
    x = learners[pair]
    drafter, target = tokenizers[pair[0]], tokenizers[pair[1]]
    context = target.tokenize("Once upon a time " + text + " the end", add_bos=target.special.bos is not None)
    x.learn(context)
    for dseq, tseq in x.cache.items():
        assert x.pair.draft_text(list(dseq)) == x.pair.target_text(list(tseq)), (dseq, tseq)
        assert len(tseq) <= len(dseq)
    draft = drafter.tokenize(draft_text)
    q = [0.5] * len(draft)
    tr = translate(draft, q, x.pair.direct, x.cache.longest_match)
    again = translate(draft, q, x.pair.direct, x.cache.longest_match)
    assert tr.tokens == again.tokens  # deterministic merging
    assert len(tr.tokens) <= len(draft)  # m <= k
    produced = x.pair.target_text(tr.tokens)
    spelled = x.pair.draft_text(draft[: tr.consumed])
    assert produced == spelled and x.pair.draft_text(draft).startswith(produced)


def test_learning_covers_multi_token_spellings(learners, tokenizers) -> None:
    """OmniDraft's example: a target word the drafter spells in pieces becomes one entry."""
    x = learners[("llama-spm", "gpt-2")]
    target = tokenizers["gpt-2"]
    before = len(x.cache)
    x.learn(target.tokenize("The snowflake fell on the windowsill while stamps were collected."))
    assert len(x.cache) > before
    assert any(len(d) > 1 and len(t) == 1 for d, t in x.cache.items())


# -- greedy identity on the real cross-vocabulary pair ------------------------------------------
PROMPTS = [
    "Once upon a time", "Lily and Tom went to the park.", "The cat sat on the mat and", "One day, a little boy named",
    "Sara had a red ball.", "The sun was shining and", "Tim was sad because", "Mom said, \"", "The dog ran", "In the forest,",
    "Ben wanted to fly", "The little bird", "They played all day", "Anna found a box", "The big tree", "Max and his friend",
]


CFG = LlamaConfig(n_ctx=512, n_threads=1)
"""One thread: these models are tiny, and on a shared CPU more threads only contend."""


def _greedy_pair(target, drafter, mode: str, prompts: list[str], n: int = 128, k: int = 4,
                 logit_bias: tuple[tuple[int, float], ...] = ()) -> CrossVocabDrafter:
    from tandem.runtime.generate import autoregressive

    x = CrossVocabDrafter(drafter, target, XVocabConfig(mode=mode, persist=False), owns_backend=False)
    strategy = speculative(x, FixedLength(k), hook=_check_invariant)
    for text in prompts:
        prompt = target.tokenize(text, add_bos=True)
        greedy = Sampler(SamplingParams(temperature=0.0, logit_bias=logit_bias))
        plain = list(generate(target, prompt, greedy, strategy=autoregressive, max_tokens=n, stop_at_eog=False))[-1]
        spec = list(generate(target, prompt, greedy, strategy=strategy, max_tokens=n, stop_at_eog=False))[-1]
        assert spec.tokens == plain.tokens, text
        full = prompt + plain.tokens
        assert len(target.tokens) >= len(full) - 1 and target.tokens == full[: len(target.tokens)]
    return x


def _check_invariant(target, drafter, context) -> None:
    assert target.tokens == context[:-1]  # the strategy keeps the last token for the next verify


def test_greedy_identity_spm_drafter_for_bpe_target(tinystories656k_gguf: Path, stories260k: Path) -> None:
    with LlamaCppBackend(tinystories656k_gguf, CFG) as target, \
            LlamaCppBackend(stories260k, CFG) as drafter:
        x = _greedy_pair(target, drafter, "omni", PROMPTS[:6])
        assert x.stats.proposed > 0 and x.stats.accepted > 0 and len(x.cache) > 0
        _greedy_pair(target, drafter, "tli", PROMPTS[6:8])


def test_greedy_identity_reverse_pair(tinystories656k_gguf: Path, stories260k: Path) -> None:
    with LlamaCppBackend(stories260k, CFG) as target, \
            LlamaCppBackend(tinystories656k_gguf, CFG) as drafter:
        x = _greedy_pair(target, drafter, "omni", PROMPTS[8:11])
        assert x.stats.proposed > 0 and x.stats.accepted > 0


def test_greedy_identity_under_a_logit_bias_of_target_ids(tinystories656k_gguf: Path, stories260k: Path) -> None:
    """The bias names the target's ids, which mean other tokens (or none) in the
    drafter's vocabulary: the drafter drafts without it, verification applies it."""
    with LlamaCppBackend(tinystories656k_gguf, CFG) as target, \
            LlamaCppBackend(stories260k, CFG) as drafter:
        assert target.n_vocab > drafter.n_vocab
        the = target.tokenize(" the")[-1]
        bias = ((the, -math.inf), (target.n_vocab - 1, 1.0), (drafter.n_vocab + 5, 0.5))
        x = _greedy_pair(target, drafter, "omni", PROMPTS[:4], logit_bias=bias)
        assert x.stats.proposed > 0 and x.stats.accepted > 0


def test_cache_persists_across_runs(tinystories656k_gguf: Path, stories260k: Path, isolated_home: Path) -> None:
    with LlamaCppBackend(tinystories656k_gguf, CFG) as target:
        first = CrossVocabDrafter(LlamaCppBackend(stories260k, CFG), target)
        text = 'One day, Sara saw her friend Tom was trying to catch it. Sam said, "Tom, let\'s play catch!"\n'
        first.learn(target.tokenize(text, add_bos=True))
        learnt = sorted(first.cache.items())
        first.close()
        assert learnt and first.cache_path.is_file() and isolated_home in first.cache_path.parents
        second = CrossVocabDrafter(LlamaCppBackend(stories260k, CFG), target)
        assert sorted(second.cache.items()) == learnt
        second.close()
