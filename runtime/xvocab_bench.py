"""Learning with use: acceptance of a drafter, cold vs after a warm-up on similar text.

``python -m tandem.runtime.xvocab_bench TARGET.gguf XVOCAB_DRAFTER.gguf [DISTILLED.gguf]``
runs greedy speculative decoding (fixed draft length) over a test prompt set with an
empty n-gram cache, then generates from a separate warm-up prompt set (same domain),
then reruns the test set; a fresh drafter that loads the persisted cache shows the
gain survives a restart. Prints one JSON object.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from tandem.kernels.sampling import Sampler, SamplingParams
from tandem.runtime.adaptive import FixedLength
from tandem.runtime.generate import DoneEvent, generate
from tandem.runtime.llama_backend import LlamaConfig, LlamaCppBackend
from tandem.runtime.speculative import speculative

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
    out = {"acceptance": accepted / drafted if drafted else 0.0, "tokens_per_call": produced / rounds}
    if hasattr(drafter, "telemetry"):
        t = drafter.telemetry()
        out.update(cache_size=t["cache_size"])
    return out


def main(argv: list[str]) -> None:
    from tandem.runtime.drafters.model import ModelDrafter
    from tandem.runtime.drafters.xvocab import CrossVocabDrafter, XVocabConfig

    cfg = LlamaConfig(n_ctx=512, n_threads=1)
    report: dict[str, dict] = {}
    with LlamaCppBackend(argv[0], cfg) as target, tempfile.TemporaryDirectory() as tmp:
        cache_file = Path(tmp) / "cache.json"
        x = CrossVocabDrafter(LlamaCppBackend(argv[1], cfg), target, XVocabConfig(cache_path=cache_file))
        cold = run_set(target, x, TEST)
        x.cache.__init__(x.cache.capacity)  # forget what the test set itself taught
        x._learnt_ctx, x._learnt_byte = [], 0
        run_set(target, x, WARM)
        warm = run_set(target, x, TEST)
        second = run_set(target, x, TEST)
        x.close()
        y = CrossVocabDrafter(LlamaCppBackend(argv[1], cfg), target, XVocabConfig(cache_path=cache_file, learn=False))
        restarted = run_set(target, y, TEST)
        y.close()
        report["xvocab_omni"] = {"cold": cold, "after_warmup": warm, "after_restart_persisted": restarted,
                                 "same_text_second_pass": second}
        if len(argv) > 2:
            with LlamaCppBackend(argv[2], cfg) as d:
                report["distilled"] = {"cold": run_set(target, ModelDrafter(d, owns_backend=False), TEST)}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
