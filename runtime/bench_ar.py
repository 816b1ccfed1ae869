"""Plain decoding overhead: Tandem's generate loop against llama-cpp-python's own.

Both decode the same prompts greedily on the same GGUF file with the same threads and
context, alternating run by run so machine noise hits both alike; the result is the
median ratio of Tandem's tokens/s to ``Llama.generate``'s.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import llama_cpp

from tandem.kernels.sampling import Sampler, SamplingParams
from tandem.runtime.generate import DoneEvent, generate
from tandem.runtime.llama_backend import LlamaConfig, LlamaCppBackend, default_threads

PROMPTS = [
    "Once upon a time",
    "The little dog ran to the park and",
    "Lily and Tom wanted to build a big castle",
    "One day, a bird found a shiny stone",
]


@dataclass
class OverheadResult:
    model: str
    tokens: int
    rounds: int
    tandem_tps: float
    llama_tps: float
    ratio: float
    """Tandem / llama-cpp-python decode speed (median of per-round ratios)."""
    identical: bool

    def as_dict(self) -> dict:
        return asdict(self)


def _llama_generate(llm: llama_cpp.Llama, prompt: list[int], n: int) -> tuple[list[int], float]:
    out: list[int] = []
    start = time.perf_counter()
    first = None
    for tok in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        if first is None:
            first = time.perf_counter()
        out.append(tok)
        if len(out) >= n:
            break
    end = time.perf_counter()
    return out, (len(out) - 1) / (end - (first or start))


def _tandem_generate(backend: LlamaCppBackend, prompt: list[int], n: int) -> tuple[list[int], float]:
    backend.truncate(0)
    done = None
    for ev in generate(backend, prompt, Sampler(SamplingParams.greedy_params()), max_tokens=n, stop_at_eog=False):
        if isinstance(ev, DoneEvent):
            done = ev
    assert done is not None
    return done.tokens, done.stats.tokens_per_s


def measure_overhead(model: Path, tokens: int = 128, rounds: int = 3, threads: int | None = None) -> OverheadResult:
    threads = threads or default_threads()
    backend = LlamaCppBackend(model, LlamaConfig(n_ctx=1024, n_threads=threads))
    llm = llama_cpp.Llama(
        str(model), n_ctx=1024, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False
    )
    ratios, ours, theirs, identical = [], [], [], True
    try:
        for r in range(rounds):
            for i, text in enumerate(PROMPTS):
                prompt = backend.tokenize(text, add_bos=True)
                # Alternate which goes first so warm caches favour neither.
                order = [0, 1] if (r + i) % 2 == 0 else [1, 0]
                res: dict[int, tuple[list[int], float]] = {}
                for which in order:
                    res[which] = _tandem_generate(backend, prompt, tokens) if which == 0 else _llama_generate(llm, prompt, tokens)
                identical &= res[0][0] == res[1][0][: len(res[0][0])]
                ours.append(res[0][1])
                theirs.append(res[1][1])
                ratios.append(res[0][1] / res[1][1])
    finally:
        backend.close()
        llm.close()
    return OverheadResult(
        model=model.name,
        tokens=tokens,
        rounds=rounds,
        tandem_tps=statistics.median(ours),
        llama_tps=statistics.median(theirs),
        ratio=statistics.median(ratios),
        identical=identical,
    )
