"""Editor completions (runtime/autocomplete/infill.py): where a suggestion ends, prompt-cache reuse,
and seeded sampling that repeats whatever drafting does."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.kernels.sampling import Sampler, keyed_uniform
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.autocomplete.infill import (
    InfillChunk,
    InfillDone,
    InfillLimits,
    TextCutter,
    reusable_spans,
    run_infill,
)
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_config import LlamaConfig
from tandem.runtime.generate import DoneEvent, generate
from tandem.runtime.speculative.factory import SpecOptions, build_strategy


def _feed_all(limits: InfillLimits, pieces: list[str], elapsed: list[float] | None = None) -> tuple[str, str | None]:
    """Feed ``pieces``; what was shown along the way must add up to the final text."""
    cut = TextCutter(limits)
    shown, stop = [], None
    for i, p in enumerate(pieces):
        text, stop = cut.feed(p, elapsed[i] if elapsed else 0.0)
        shown.append(text)
        if stop:
            break
    if stop is None:
        shown.append(cut.flush())
    assert "".join(shown) == cut.text  # a stream never shows what the reply then cuts
    return cut.text, stop


def test_n_indent_ends_at_a_less_indented_line() -> None:
    pieces = ["x = 1\n", "    y = 2\n", "  ", "  z = 3\n", "  w", " = 4\n"]
    text, stop = _feed_all(InfillLimits(n_indent=4), pieces)
    assert (text, stop) == ("x = 1\n    y = 2\n    z = 3\n", "limit")
    # the first line continues the cursor line and is never judged; blank lines wait
    text, stop = _feed_all(InfillLimits(n_indent=8), ["a\n", "\n", "        b\n"])
    assert (text, stop) == ("a\n\n        b\n", None)
    # a cut inside one multi-line piece (speculative commits bring several tokens at once)
    text, stop = _feed_all(InfillLimits(n_indent=2), ["if x:\n  y\nz\n  w\n"])
    assert (text, stop) == ("if x:\n  y\n", "limit")


def test_t_max_predict_ms_ends_at_the_next_line_end() -> None:
    limits = InfillLimits(t_max_predict_ms=100)
    text, stop = _feed_all(limits, ["a = 1", "\nb", " = 2", "\nc = 3\n"], [10, 50, 150, 160])
    assert (text, stop) == ("a = 1\nb = 2\n", "limit")
    text, stop = _feed_all(limits, ["a = 1", "\nb = 2\n"], [10, 50])
    assert (text, stop) == ("a = 1\nb = 2\n", None)


def test_stop_strings_name_the_word() -> None:
    cut = TextCutter(InfillLimits(stop=("END", "\n\n")))
    shown = []
    for piece in ["x = 1", "\n", "E", "N", "D tail"]:
        text, stop = cut.feed(piece, 0.0)
        shown.append(text)
        if stop:
            break
    assert (cut.text, stop, cut.stopping_word) == ("x = 1\n", "word", "END")
    assert "".join(shown) == cut.text
    held = TextCutter(InfillLimits(stop=("END",)))
    held.feed("x = E", 0.0)
    assert held.flush() == "E" and held.text == "x = E"  # a held-back partial stop comes out at the end


def test_keyed_sampling_follows_the_distribution() -> None:
    probs = np.array([0.5, 0.3, 0.2])
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7))
    logits = np.log(probs)
    draws = np.array([s.sample_at(logits, pos) for pos in range(6000)])
    freq = np.bincount(draws, minlength=3) / len(draws)
    assert np.all(np.abs(freq - probs) < 0.03), freq
    assert [s.sample_at(logits, pos) for pos in range(50)] == list(draws[:50])  # fixed by (seed, position)
    other = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=8))
    assert [other.sample_at(logits, pos) for pos in range(50)] != list(draws[:50])
    u = [keyed_uniform(3, p) for p in range(1000)]
    assert min(u) >= 0.0 and max(u) < 1.0 and abs(np.mean(u) - 0.5) < 0.05


@pytest.fixture(scope="module")
def qwen(real_models):
    backend = LlamaCppBackend(real_models.qwen_05b, LlamaConfig(n_ctx=1024, n_threads=2))
    yield backend
    backend.close()


FIM = "<|fim_prefix|>def add(a, b):\n    return <|fim_suffix|>\n\nprint(add(1, 2))\n<|fim_middle|>"


def _run(target, prompt, limits, *, params=None, strategy=None, cache_prompt=True, cache_reuse=0) -> InfillDone:
    sampler = Sampler(params or SamplingParams.greedy_params())
    kwargs = {"strategy": strategy} if strategy is not None else {}
    events = list(run_infill(target, prompt, sampler, limits, cache_prompt=cache_prompt, cache_reuse=cache_reuse,
                             **kwargs))
    done = events[-1]
    assert isinstance(done, InfillDone)
    assert "".join(e.text for e in events if isinstance(e, InfillChunk)) == done.content
    return done


def test_prompt_cache_reuse_evaluates_only_new_tokens(qwen) -> None:
    """Second request extends the first (the user typed more): only the new tokens are
    evaluated, and the text is the same as without reuse (greedy)."""
    first = qwen.tokenize(FIM, special=True)
    second = qwen.tokenize(FIM.replace("return <|fim_suffix|>", "return a<|fim_suffix|>"), special=True)
    limits = InfillLimits(n_predict=6)
    qwen.truncate(0)
    cold = _run(qwen, first, limits)
    assert cold.tokens_cached == 0 and cold.timings.prompt_n == len(first)
    warm = _run(qwen, second, limits)
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert warm.tokens_cached == shared and warm.timings.prompt_n == len(second) - shared
    assert warm.timings.prompt_n < cold.timings.prompt_n
    fresh = _run(qwen, second, limits, cache_prompt=False)
    assert fresh.tokens_cached == 0 and fresh.timings.prompt_n == len(second)
    assert fresh.content == warm.content and warm.content


def test_reusable_spans_follow_the_prompt_in_order() -> None:
    cached = [1, 2, 3, 10, 11, 12, 13, 20, 21, 22, 23, 9]
    prompt = [1, 2, 3, 20, 21, 22, 23, 30, 31]
    assert reusable_spans(cached, prompt, 0) == [(0, 3)]  # off: the common prefix only
    assert reusable_spans(cached, prompt, 4) == [(0, 3), (7, 11)]  # a moved run of 4
    assert reusable_spans(cached, prompt, 5) == [(0, 3)]  # shorter than the minimum
    assert reusable_spans([5, 1, 2], [1, 2], 2) == [(1, 3)]  # no common prefix, a later run
    assert reusable_spans([], prompt, 2) == []


# llama.vim's ring of extra chunks rotates between requests: the oldest file leaves the
# front of the prompt, so everything after it sits at new positions.
CHUNKS = [
    "<|file_sep|>util.py\ndef clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n\n\ndef lerp(a, b, t):\n"
    "    return a + (b - a) * t\n",
    "<|file_sep|>shapes.py\nclass Rect:\n    def __init__(self, w, h):\n        self.w, self.h = w, h\n\n"
    "    def area(self):\n        return self.w * self.h\n",
    "<|file_sep|>io_utils.py\nimport json\n\n\ndef load(path):\n    with open(path) as f:\n        return json.load(f)\n",
    "<|file_sep|>stats.py\ndef mean(xs):\n    return sum(xs) / len(xs)\n",
]
CURSOR = "<|file_sep|>main.py\n<|fim_prefix|>from shapes import Rect\n\nr = Rect(3, 4)\nprint(r.<|fim_suffix|>)\n<|fim_middle|>"


def test_cache_reuse_moves_rotated_chunks_instead_of_recomputing(qwen) -> None:
    """``cache_reuse`` (llama-server's ``--cache-reuse``): the two chunks both prompts share
    are shifted into place, only the rest is evaluated, and the fill is the fresh one's."""
    def tokens(*texts: str) -> list[int]:
        return [t for text in texts for t in qwen.tokenize(text, special=True)]

    head = tokens("<|repo_name|>demo\n")
    first = head + tokens(*CHUNKS[:3], CURSOR)
    second = head + tokens(*CHUNKS[1:], CURSOR)
    limits = InfillLimits(n_predict=4)
    qwen.truncate(0)
    _run(qwen, first, limits)
    shared = len(head) + len(tokens(CHUNKS[1])) + len(tokens(CHUNKS[2]))
    plain = _run(qwen, second, limits)  # the common prefix only: everything after it again
    assert plain.tokens_cached < len(head) + 2  # the repo line and the first <|file_sep|>
    qwen.truncate(0)
    _run(qwen, first, limits)
    moved = _run(qwen, second, limits, cache_reuse=16)
    assert moved.tokens_cached >= shared and moved.timings.prompt_n <= len(second) - shared
    fresh = _run(qwen, second, limits, cache_prompt=False)
    assert moved.content == fresh.content and "area" in fresh.content


def test_warm_up_fills_the_cache(qwen) -> None:
    prompt = qwen.tokenize(FIM, special=True)
    qwen.truncate(0)
    warm = _run(qwen, prompt, InfillLimits(n_predict=0))
    assert (warm.content, warm.timings.predicted_n, warm.tokens_cached) == ("", 0, 0)
    assert qwen.tokens == prompt
    after = _run(qwen, prompt, InfillLimits(n_predict=3))
    assert after.tokens_cached == len(prompt) - 1 and after.timings.prompt_n == 1


def test_seeded_sampling_repeats_with_and_without_speculation(qwen) -> None:
    prompt = qwen.tokenize("def fibonacci(n):\n", add_bos=False)
    params = SamplingParams(temperature=0.9, seed=11)
    spec = build_strategy(qwen, None, SpecOptions(mode="ngram", draft_length=4))
    try:
        texts, drafted = [], 0
        for strategy in (None, spec, spec, spec):
            events = generate(qwen, prompt, Sampler(params), max_tokens=24,
                              **({"strategy": strategy} if strategy else {}))
            done = [e for e in events if isinstance(e, DoneEvent)][0]
            texts.append(done.text)
            drafted += done.stats.drafted_tokens
    finally:
        spec.close()
    assert drafted > 0  # the suffix tree learnt the first texts and drafted the later ones
    assert texts[0] and len(set(texts)) == 1, texts
