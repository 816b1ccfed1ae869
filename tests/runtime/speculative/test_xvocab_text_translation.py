"""Text-level cross-vocabulary translation (``CrossVocabDrafter`` mode ``text``).

* Pure helpers: dummy-prefix stripping, per-token confidence.
* Real tokenizers (the 656k BPE and Llama SPM / GPT-2 / StarCoder vocab-only GGUFs),
  fuzzed with hypothesis: translation never invents text (the proposed tokens' bytes
  are a prefix of the drafted text), holds back the newest token, proposes at most one
  token per drafted byte, and a look-behind proposal continues the committed tokens the
  way the target tokenizer would.
* A perfect-text drafter (the target tokenizer's own continuation) is reproduced.
* Exactness under sampling (greedy drafting, one-hot q) on toy Markov models, and
  greedy identity on the real pair stories260K <-> tinystories-656k, both directions.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from toy_models import check_matches, exact_joint, model_distribution, random_table, sequence_counts
from toy_vocab import DRAFT_PIECES, TARGET_PIECES, PieceToy

from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.kernels.vocab_map import text_confidence
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_config import LlamaConfig
from tandem.runtime.backends.llama_vocab import LlamaVocab
from tandem.runtime.generate import autoregressive, generate
from tandem.runtime.speculative.drafters.xvocab.drafter import CrossVocabDrafter, XVocabConfig
from tandem.runtime.speculative.drafters.xvocab.text_translation import (
    TextTranslator,
    strip_leading,
)
from tandem.runtime.speculative.drafters.xvocab.vocab_pair import pieces_of
from tandem.runtime.speculative.loop import speculative
from tandem.runtime.speculative.policy.base import FixedLength


# -- pure helpers ---------------------------------------------------------------------------
def test_strip_leading_cuts_whole_dummy_tokens_only() -> None:
    pieces = [b" ", b"On", b"ce", b" On", b"x"]
    assert strip_leading([0, 1, 2], pieces, b"Once") == [1, 2]
    assert strip_leading([1, 2], pieces, b"Once") == [1, 2]
    assert strip_leading([3, 2], pieces, b"Once") is None  # the dummy space merged into " On"
    assert strip_leading([0, 4], pieces, b"Once") is None  # spells other text
    assert strip_leading([0], pieces, b"") == []


def test_text_confidence_charges_each_drafter_token_once() -> None:
    # drafter tokens end at bytes 3, 7, 10; target tokens end at 5, 7, 10
    conf = text_confidence([5, 7, 10], [3, 7, 10], [0.5, 0.4, 0.9])
    assert conf == pytest.approx([0.2, 1.0, 0.9])
    assert text_confidence([2, 3], [3], [0.7]) == pytest.approx([0.7, 1.0])


# -- real tokenizers --------------------------------------------------------------------------
TARGETS = ["656k", "llama-spm", "gpt-2", "starcoder"]


@pytest.fixture(scope="module")
def translators(vocab_gguf: Path, tinystories656k_gguf: Path):
    paths = {n: vocab_gguf / f"ggml-vocab-{n}.gguf" for n in TARGETS[1:]} | {"656k": tinystories656k_gguf}
    toks = {n: LlamaVocab.open(p) for n, p in paths.items()}
    yield {n: TextTranslator(t, pieces_of(t)) for n, t in toks.items()}
    for t in toks.values():
        t.close()


WORDS = st.sampled_from(["Once ", "upon a time", ", ", "there was a ", "little girl", " named ", "Lily", ".", "\n",
                         " the", "re", " was", "said, \"", "Yes", "!\" ", "  ", "déjà vu", "🙂", "def f(x):", "\t"])
TEXT = st.lists(st.one_of(WORDS, st.characters(codec="utf-8", exclude_categories=("Cs", "Cc"))),
                min_size=1, max_size=12).map("".join)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(committed=TEXT, drafted=TEXT, cut=st.integers(0, 3))
@pytest.mark.parametrize("name", TARGETS)
def test_translation_never_invents_text(translators, name: str, committed: str, drafted: str, cut: int) -> None:
    tr = translators[name]
    committed = committed[: tr.encodable(committed)] or "Once"  # llama.cpp aborts on the rest
    context = tr.target.tokenize(committed, add_bos=tr.target.special.bos is not None)
    data = drafted.encode()
    data = data[: max(len(data) - cut, 0)]  # sometimes end mid-character
    prop = tr.propose(context, data)
    spelled = b"".join(tr.pieces[t] for t in prop.tokens)
    assert data.startswith(spelled)
    safe = data[: max(0, _utf8_len(data))].decode("utf-8")
    assert len(spelled) <= len(safe[: tr.encodable(safe)].encode("utf-8"))  # only encodable text is handed over
    assert len(prop.tokens) <= len(data)  # m is bounded by the drafted text
    assert prop.ends == [len(b"".join(tr.pieces[t] for t in prop.tokens[: i + 1])) for i in range(len(prop.tokens))]
    if prop.held_back:
        assert len(spelled) < len(data)  # the newest token is held back
    final = tr.propose(context, data, final=True)  # the text ended: nothing held back
    assert data.startswith(b"".join(tr.pieces[t] for t in final.tokens))
    assert final.tokens[: len(prop.tokens)] == prop.tokens and len(final.tokens) >= len(prop.tokens)


def _utf8_len(data: bytes) -> int:
    from tandem.runtime.speculative.drafters.xvocab.vocab_pair import complete_utf8_prefix

    return complete_utf8_prefix(data)


STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the sun. "
         "One day, she saw a big red ball in the park. \"Can I play with it?\" she asked her mom. "
         "Her mom said, \"Yes, you can!\" Lily was very happy.\n")


@pytest.mark.parametrize("name", TARGETS)
def test_perfect_text_drafter_is_reproduced(translators, name: str) -> None:
    """Drafting exactly the text the target tokenizer would encode next, the proposal is
    (nearly always) the target tokenizer's own next tokens."""
    tr = translators[name]
    bos = tr.target.special.bos is not None
    full = tr.target.tokenize(STORY, add_bos=bos)
    ends = np.cumsum([len(tr.pieces[t]) for t in full])
    hits = total = 0
    for i in range(2, len(full) - 6):
        drafted = b"".join(tr.pieces[t] for t in full[i : i + 6])
        prop = tr.propose(full[:i], drafted)
        n = 0
        while n < len(prop.tokens) and prop.tokens[n] == full[i + n]:
            n += 1
        hits, total = hits + n, total + len(prop.tokens)
        assert ends[i - 1] + len(b"".join(tr.pieces[t] for t in prop.tokens)) <= ends[i + 5]
    assert total > 0 and hits / total >= 0.9, (hits, total)


# -- sampling: exact with greedy drafting + one-hot q ------------------------------------------
@pytest.mark.parametrize("k", [1, 3])
def test_text_mode_sampling_follows_the_target_exactly(k: int) -> None:
    rng = np.random.default_rng(11 + k)
    target = PieceToy(random_table(len(TARGET_PIECES), rng, zeros=0.2), TARGET_PIECES, "t")
    drafter = PieceToy(random_table(len(DRAFT_PIECES), rng), DRAFT_PIECES, "d")
    x = CrossVocabDrafter(drafter, target, XVocabConfig(mode="text", persist=False))
    strategy = speculative(x, FixedLength(k))
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0))
    sampler.rng = np.random.default_rng(k)  # unkeyed draws (a seed keys each position: one outcome)
    length = 2
    counts = sequence_counts(strategy, target, sampler, [0], length, 6_000)
    joint = exact_joint(model_distribution(target), 0, length)
    keys = sorted(set(joint) | set(counts))
    check_matches(np.array([counts.get(s, 0) for s in keys]), np.array([joint.get(s, 0.0) for s in keys]), 0.05)
    assert x.stats.proposed > 0 and x.stats.accepted > 0


# -- greedy identity on the real cross-vocabulary pair ------------------------------------------
PROMPTS = [
    "Once upon a time", "Lily and Tom went to the park.", "The cat sat on the mat and", "One day, a little boy named",
    "Sara had a red ball.", "The sun was shining and", "Tim was sad because", "Mom said, \"", "The dog ran", "In the forest,",
    "Ben wanted to fly", "The little bird", "They played all day", "Anna found a box", "The big tree", "Max and his friend",
]
CFG = LlamaConfig(n_ctx=512, n_threads=1)


def _identity(target, drafter, prompts: list[str], k: int, n: int = 128) -> CrossVocabDrafter:
    x = CrossVocabDrafter(drafter, target, XVocabConfig(persist=False), owns_backend=False)
    assert x.config.mode == "text"  # the default
    propose = x.propose

    def checked(context, max_tokens, sampler):
        draft = propose(context, max_tokens, sampler)
        assert len(draft.tokens) <= max_tokens and draft.q is None
        assert x.last_drafted.startswith(x.pair.target_text(draft.tokens))  # never invents text
        return draft

    x.propose = checked
    strategy = speculative(x, FixedLength(k))
    greedy = Sampler(SamplingParams.greedy_params())
    for text in prompts:
        prompt = target.tokenize(text, add_bos=True)
        plain = list(generate(target, prompt, greedy, strategy=autoregressive, max_tokens=n, stop_at_eog=False))[-1]
        spec = list(generate(target, prompt, greedy, strategy=strategy, max_tokens=n, stop_at_eog=False))[-1]
        assert spec.tokens == plain.tokens, text
    return x


def test_greedy_identity_text_mode(tinystories656k_gguf: Path, stories260k: Path) -> None:
    with LlamaCppBackend(tinystories656k_gguf, CFG) as target, LlamaCppBackend(stories260k, CFG) as drafter:
        x = _identity(target, drafter, PROMPTS[:12], k=4)
        x = _identity(target, drafter, PROMPTS[12:], k=2) if x.stats.accepted else x
        assert x.stats.proposed > 0 and x.stats.accepted > 0 and x.stats.anchored > 0


def test_greedy_identity_text_mode_reverse_pair(tinystories656k_gguf: Path, stories260k: Path) -> None:
    with LlamaCppBackend(stories260k, CFG) as target, LlamaCppBackend(tinystories656k_gguf, CFG) as drafter:
        x = _identity(target, drafter, PROMPTS[:4], k=3)
        assert x.stats.proposed > 0 and x.stats.accepted > 0


def test_characters_a_vocabulary_lacks_never_reach_llama_cpp(tinystories656k_gguf: Path, stories260k: Path) -> None:
    """llama.cpp aborts the process when the 656k vocabulary (no byte fallback) meets a
    character it lacks; the drafter must skip such text rather than tokenize it."""
    drafter, target = LlamaVocab.open(tinystories656k_gguf), LlamaVocab.open(stories260k)
    try:
        x = CrossVocabDrafter(drafter, target, XVocabConfig(persist=False), owns_backend=False)
        context = target.tokenize("Lily ate a crêpe au café.", add_bos=True)
        assert x._sync(context) is None and x._sync(context, hold_space=True) is None
        x.learn(context)  # learning skips what it cannot encode
        assert x._sync(target.tokenize("Lily ate a cake.", add_bos=True)) is not None
    finally:
        drafter.close()
        target.close()


def test_a_growing_context_encodes_its_tail_only_and_as_the_whole_would(real_models) -> None:
    """Each round the committed text grows by a few tokens: the drafter keeps its encoding
    up to a word boundary and encodes only the rest again. On real text (prose, code,
    chat markup, digits, non-ASCII) and the real pair, SmolLM2 drafting for Qwen2.5-Coder,
    the ids equal the whole text's encoding at every step, and the tail path was taken."""
    target = LlamaVocab.open(real_models.qwen_15b)
    drafter = LlamaCppBackend(real_models.smollm2, LlamaConfig(n_ctx=256, n_threads=1))
    try:
        incremental = CrossVocabDrafter(drafter, target, XVocabConfig(persist=False), owns_backend=False)
        text = ("<|im_start|>user\nWrite a function that sums 1234 + 5678, and explain it. Ça va? "
                "Les élèves ont 3,5 points.<|im_end|>\n<|im_start|>assistant\n"
                "def add(a: int, b: int) -> int:\n    \"\"\"Add two numbers.\"\"\"\n    return a + b\n\n"
                "print(add(1234, 5678))  # 6912\n\nThe function `add` takes two integers and returns their sum; "
                "calling it with 1234 and 5678 prints 6912. It works for negative numbers too: add(-3, 5) is 2. ") * 4
        context = target.tokenize(text, special=True)
        whole = CrossVocabDrafter(drafter, target, XVocabConfig(persist=False), owns_backend=False)
        encode_whole, whole_encodings = incremental._encode, []
        incremental._encode = lambda *args: whole_encodings.append(args) or encode_whole(*args)  # type: ignore[method-assign]
        steps = range(40, len(context), 3)
        for end in steps:
            synced = incremental._sync(context[:end])
            whole._synced.clear()
            expected = whole._sync(context[:end])
            assert (synced is None) == (expected is None)
            if synced is None or expected is None:
                continue
            assert synced.draft_ids == expected.draft_ids, end
            assert (synced.text, synced.offset) == (expected.text, expected.offset)
        assert len(whole_encodings) <= 3, f"{len(whole_encodings)} of {len(steps)} rounds encoded the whole text"
    finally:
        drafter.close()
