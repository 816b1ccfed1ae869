"""llama-cpp-python as the outside peer of `tandem bench`: plain greedy and prompt lookup.

Both run in the bench's own process on the same GGUF file, with the same threads and
context as Tandem's target and the same prompt token ids, through ``Llama.generate``.
They use llama-cpp-python's *default* model settings, which let llama.cpp repack the
weights for its fastest CPU kernels, whereas Tandem's backend defaults to
``LlamaConfig(exact=True)`` (no repacking) and repacks only with ``--repack`` (verify calls
of at most 3 tokens then), so that greedy speculative output is token-identical to plain
output either way: the peers' output may differ from Tandem's in a late token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

PEERS = ("llama", "llama-lookup")
PEER_NOTE = ("llama / llama-lookup: llama-cpp-python's Llama (default settings: weights repacked for "
             "llama.cpp's fastest CPU kernels) plain greedy / with LlamaPromptLookupDecoding(num_pred_tokens=10); "
             "Tandem's backend: see tandem_backend (by default not repacked; --repack: repacked too)")


@dataclass
class RunResult:
    """One timed generation."""

    tokens: list[int]
    tokens_per_s: float
    """Decode rate: tokens after the first over the time after the first."""
    cpu_tokens_per_s: float
    """The same over this process's CPU time (steadier than wall time on a busy box
    when every engine uses one thread)."""
    target_calls: int
    drafted: int
    accepted: int
    setup_s: float = 0.0
    """Time to build the configuration before the run (not part of the decode rate)."""
    describe: dict = field(default_factory=dict)


def decode_rate(n_tokens: int, seconds: float) -> float:
    """Tokens after the first over the seconds after the first (as GenerationStats)."""
    return (n_tokens - 1) / seconds if n_tokens > 1 and seconds > 0 else 0.0


class _CountingLookup(LlamaPromptLookupDecoding):
    """Prompt lookup that counts the tokens it proposes."""

    def __init__(self, num_pred_tokens: int) -> None:
        super().__init__(num_pred_tokens=num_pred_tokens)
        self.drafted = 0

    def __call__(self, input_ids: np.ndarray, /, **kwargs) -> np.ndarray:
        draft = super().__call__(input_ids, **kwargs)
        self.drafted += len(draft)
        return draft


class _CountingLlama(llama_cpp.Llama):
    """``Llama`` that counts its ``eval`` calls (one per verify batch)."""

    eval_calls = 0

    def eval(self, tokens) -> None:
        self.eval_calls += 1
        return super().eval(tokens)


class LlamaPeer:
    """One llama-cpp-python engine: ``lookup`` adds its prompt-lookup drafter;
    ``n_gpu_layers`` as Tandem's target was planned (-1: all on the GPU)."""

    def __init__(self, path: Path, *, n_ctx: int, threads: int, lookup: bool, num_pred_tokens: int = 10,
                 n_gpu_layers: int = 0) -> None:
        self.name = "llama-lookup" if lookup else "llama"
        self.lookup = _CountingLookup(num_pred_tokens) if lookup else None
        # With a draft model llama-cpp-python keeps logits for every position but sizes its
        # score table by the ``logits_all`` argument (n_batch rows otherwise): a prompt and
        # reply past 512 tokens then failed to broadcast. Asked for, the table has n_ctx rows.
        self.llm = _CountingLlama(str(path), n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
                                  draft_model=self.lookup, logits_all=lookup, n_gpu_layers=n_gpu_layers,
                                  verbose=False)

    def run(self, prompt: list[int], n: int) -> RunResult:
        """Greedy ``n`` tokens after ``prompt`` (a cached prompt prefix is reused, as
        Tandem's prefill does)."""
        llm = self.llm
        llm.eval_calls = 0
        if self.lookup is not None:
            self.lookup.drafted = 0
        out: list[int] = []
        first = end = time.perf_counter()
        cpu_first = cpu_end = time.process_time()
        gen = llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True)
        try:
            for tok in gen:
                out.append(int(tok))
                end, cpu_end = time.perf_counter(), time.process_time()
                if len(out) == 1:
                    first, cpu_first = end, cpu_end
                if len(out) >= n:
                    break
        finally:
            gen.close()
        calls = llm.eval_calls
        # every eval after the prompt's yields its accepted draft tokens plus one
        accepted = max(0, len(out) - calls) if self.lookup is not None else 0
        return RunResult(out, decode_rate(len(out), end - first), decode_rate(len(out), cpu_end - cpu_first),
                         calls, self.lookup.drafted if self.lookup is not None else 0, accepted,
                         describe={"engine": "llama-cpp-python " + llama_cpp.__version__,
                                   "draft_model": "LlamaPromptLookupDecoding" if self.lookup else None})

    def close(self) -> None:
        self.llm.close()
