"""Learning with use: acceptance of a drafter, cold vs after a warm-up on similar text.

``python -m benchmarks.xvocab_learning TARGET.gguf XVOCAB_DRAFTER.gguf [DISTILLED.gguf ...]``
runs greedy speculative decoding (fixed draft length) over a test prompt set with an
empty n-gram cache, then generates from a separate warm-up prompt set (same domain),
then reruns the test set; a fresh drafter that loads the persisted cache shows the
gain survives a restart. Each cross-vocabulary mode in ``XVOCAB_MODES`` (environment,
comma-separated; default ``text,omni``) is run in turn; every further GGUF is measured
as a same-vocabulary model drafter. Prints one JSON object.

``python -m benchmarks.xvocab_learning --chats TARGET.gguf XVOCAB_DRAFTER.gguf [N_CHATS] [TOKENS]``
follows one user through a sequence of chats (:data:`CHATS`, ChatML through the target's
template): the acceptance of each chat for ``text`` (no memory) and ``omni`` (OmniDraft's
translation cache, starting empty and learning from every chat before it), fixed k = 4.

``python -m benchmarks.xvocab_learning --speed TARGET.gguf XVOCAB_DRAFTER.gguf [REPS]``
times plain decoding against each mode at fixed draft lengths on one target (a cost
twin), configurations alternating within every repetition; medians of tokens/s.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_config import LlamaConfig
from tandem.runtime.generate import DoneEvent, generate
from tandem.runtime.speculative.loop import speculative
from tandem.runtime.speculative.policy.base import FixedLength

TEST = ["Once upon a time", "Lily and Tom went to the park.", "One day, a little boy named", "Sara had a red ball.",
        "The sun was shining and", "Tim was sad because", "The little bird", "Anna found a box"]
WARM = ["The cat sat on the mat and", "Mom said, \"", "The dog ran", "In the forest,", "Ben wanted to fly",
        "They played all day", "The big tree", "Max and his friend", "There was a girl", "The boy had a toy",
        "It was a sunny day.", "A little fish"]


def run_set(target, drafter, prompts: list[str], n: int = 128, k: int = 4) -> dict[str, float]:
    strategy = speculative(drafter, FixedLength(k))
    drafted = accepted = rounds = produced = 0
    for text in prompts:
        prompt = target.tokenize(text, add_bos=True)
        done = [e for e in generate(target, prompt, Sampler(SamplingParams.greedy_params()), strategy=strategy,
                                    max_tokens=n, stop_at_eog=False) if isinstance(e, DoneEvent)][0]
        drafted += done.stats.drafted_tokens
        accepted += done.stats.accepted_tokens
        rounds += done.stats.target_calls
        produced += done.stats.generated_tokens
    out = {"acceptance": accepted / drafted if drafted else 0.0, "tokens_per_call": produced / rounds,
           "drafted_per_call": drafted / rounds}
    if hasattr(drafter, "telemetry"):
        t = drafter.telemetry()
        out.update(cache_size=t["cache_size"], fallbacks=t.get("fallbacks", 0))
    return out


def learning_curve(target, drafter_path: str, cfg, xcfg, cls) -> dict[str, dict]:
    """Cold, after warm-up, same text again, and a new drafter loading the persisted cache."""
    from dataclasses import replace

    x = cls(LlamaCppBackend(drafter_path, cfg), target, xcfg)
    cold = run_set(target, x, TEST)
    x.cache.__init__(x.cache.capacity)  # forget what the test set itself taught
    x.learner.forget()
    run_set(target, x, WARM)
    warm = run_set(target, x, TEST)
    second = run_set(target, x, TEST)
    x.close()
    y = cls(LlamaCppBackend(drafter_path, cfg), target, replace(xcfg, learn=False))
    restarted = run_set(target, y, TEST)
    y.close()
    return {"cold": cold, "after_warmup": warm, "after_restart_persisted": restarted, "same_text_second_pass": second}


def speed(argv: list[str], lengths: tuple[int, ...] = (1, 2, 4), n: int = 48) -> dict:
    """Tokens/s of plain vs ``text``/``omni`` at fixed lengths, alternating, medians."""
    import statistics
    import time

    from tandem.runtime.generate import autoregressive
    from tandem.runtime.speculative.drafters.xvocab.drafter import CrossVocabDrafter, XVocabConfig

    reps = int(argv[2]) if len(argv) > 2 else 3
    cfg = LlamaConfig(n_ctx=512, n_threads=1)
    greedy = Sampler(SamplingParams.greedy_params())
    rates: dict[str, list[float]] = {}
    calls: dict[str, list[float]] = {}
    with LlamaCppBackend(argv[0], cfg) as target, LlamaCppBackend(argv[1], cfg) as d:
        drafters = {m: CrossVocabDrafter(d, target, XVocabConfig(mode=m, persist=False), owns_backend=False)
                    for m in ("text", "omni")}
        configs = {"plain": autoregressive} | {f"{m}@{k}": speculative(x, FixedLength(k))
                                               for m, x in drafters.items() for k in lengths}
        reference: dict[str, list[int]] = {}
        for rep in range(reps):
            names = list(configs)
            names = names[rep % len(names):] + names[: rep % len(names)]  # rotate the order
            for name in names:
                produced = elapsed = tc = 0.0
                for text in TEST[:2]:
                    prompt = target.tokenize(text, add_bos=True)
                    target.truncate(0)
                    t0 = time.perf_counter()
                    done = [e for e in generate(target, prompt, greedy, strategy=configs[name], max_tokens=n,
                                                stop_at_eog=False) if isinstance(e, DoneEvent)][0]
                    elapsed += time.perf_counter() - t0
                    produced += done.stats.generated_tokens
                    tc += done.stats.target_calls
                    if reference.setdefault(text, done.tokens) != done.tokens:
                        raise AssertionError(f"{name} changed the greedy output")
                rates.setdefault(name, []).append(produced / elapsed)
                calls.setdefault(name, []).append(produced / tc)
                print(f"rep {rep} {name}: {produced / elapsed:.2f} tok/s", file=sys.stderr, flush=True)
    base = rates["plain"]  # the ratio is taken within each repetition: the load drifts between them
    return {name: {"tok_s_median": statistics.median(r), "tok_s": [round(x, 2) for x in r],
                   "speedup_median": statistics.median(x / b for x, b in zip(r, base, strict=True)),
                   "tokens_per_call": statistics.median(calls[name])}
            for name, r in rates.items()}


CHATS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "How do I read a CSV file with pandas and print the first rows?",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Explain the difference between a list and a tuple in Python.",
    "Write a Python function that counts the words in a text file.",
    "How do I sort a list of dictionaries by a key in Python?",
    "Write a Python class for a stack with push, pop and peek.",
    "What does the `with` statement do in Python?",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "How do I parse JSON from a string in Python?",
    "Write a Python function that removes duplicates from a list, keeping the order.",
    "Explain list comprehensions in Python with an example.",
    "Write a Python function that checks whether a number is prime.",
    "How do I write a unit test with pytest for a function that adds two numbers?",
    "Write a Python function that flattens a nested list.",
    "What is the difference between `is` and `==` in Python?",
    "Write a Python function that reverses the words in a sentence.",
    "How do I make an HTTP GET request in Python and read the JSON reply?",
    "Write a Python function that computes the factorial of a number recursively.",
    "Explain what a Python generator is, with a short example.",
]
"""One user's coding questions, in the order they ask them."""


def chats(argv: list[str], k: int = 4) -> dict:
    """Acceptance per chat, ``text`` vs ``omni`` (module docstring, ``--chats``)."""
    from tandem.runtime.chat import chat_prompt
    from tandem.runtime.speculative.drafters.xvocab.drafter import CrossVocabDrafter, XVocabConfig

    n_chats = int(argv[2]) if len(argv) > 2 else len(CHATS)
    n = int(argv[3]) if len(argv) > 3 else 64
    cfg = LlamaConfig(n_ctx=1024, n_threads=1)
    out: dict[str, list[dict]] = {}
    with LlamaCppBackend(argv[0], cfg) as target:
        prompts = [chat_prompt(target, [{"role": "user", "content": q}])[0] for q in CHATS[:n_chats]]
        for mode in ("text", "omni"):
            with LlamaCppBackend(argv[1], cfg) as d:
                drafter = CrossVocabDrafter(d, target, XVocabConfig(mode=mode, persist=False), owns_backend=False)
                strategy = speculative(drafter, FixedLength(k))
                series = []
                for i, prompt in enumerate(prompts):
                    target.truncate(0)
                    done = [e for e in generate(target, prompt, Sampler(SamplingParams.greedy_params()),
                                                strategy=strategy, max_tokens=n) if isinstance(e, DoneEvent)][0]
                    st = done.stats
                    row = {"chat": i + 1, "acceptance": round(st.accepted_tokens / max(st.drafted_tokens, 1), 3),
                           "tokens_per_call": round(st.tokens_per_call, 3),
                           "cache_entries": int(drafter.telemetry()["cache_size"]),
                           "cache_hit_rate": round(drafter.telemetry()["cache_hit_rate"], 3)}
                    series.append(row)
                    print(f"{mode} chat {i + 1}: {row}", file=sys.stderr, flush=True)
                drafter.close()
                out[mode] = series
    return out


def main(argv: list[str]) -> None:
    if argv and argv[0] == "--chats":
        print(json.dumps(chats(argv[1:]), indent=1))
        return
    if argv and argv[0] == "--speed":
        print(json.dumps(speed(argv[1:]), indent=1))
        return
    from tandem.runtime.speculative.drafters.model import ModelDrafter
    from tandem.runtime.speculative.drafters.xvocab.drafter import CrossVocabDrafter, XVocabConfig

    cfg = LlamaConfig(n_ctx=512, n_threads=1)
    report: dict[str, dict] = {}
    modes = [m for m in os.environ.get("XVOCAB_MODES", "text,omni").split(",") if m]
    with LlamaCppBackend(argv[0], cfg) as target:
        for mode in modes:
            with tempfile.TemporaryDirectory() as tmp:
                report[f"xvocab_{mode}"] = learning_curve(target, argv[1], cfg, XVocabConfig(
                    mode=mode, cache_path=Path(tmp) / "cache.json"), CrossVocabDrafter)
        for path in argv[2:]:
            with LlamaCppBackend(path, cfg) as d:
                report[f"model:{Path(path).name}"] = {"cold": run_set(target, ModelDrafter(d, owns_backend=False), TEST)}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
