"""`tandem bench --autocomplete`: k drafts by superposition vs k sampled runs vs one k-batch.

Three ways to get k continuations of the same prompt, timed side by side, alternating
(the machine is shared, so every method runs in every round and medians are reported):

* **superposed**: one forward pass per step for all k drafts (:mod:`.superposed`);
* **(a) sequential**: k independent sampled runs, one after another (prompt KV reused);
* **(b) batched**: k sampled sequences decoded together, one llama.cpp batch of k tokens
  per step, each sequence on its own ``seq_id`` sharing the prompt's KV (copied).

Quality, for all three: perplexity of each draft under the target (temperature 1, the
model's own distribution) and distinctness (distinct-2 across the k drafts, and how
many of the k are different strings).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import llama_cpp
import numpy as np

from tandem.errors import TandemError
from tandem.kernels.sampling import Sampler, softmax
from tandem.kernels.sampling_params import SamplingParams
from tandem.kernels.superpose import SuperposeConfig, distinct_n
from tandem.runtime.autocomplete.superposed import SuperposedDecoder
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.generate import DoneEvent, generate
from tandem.runtime.machine import cpu_cores

PROMPTS = (
    "Once upon a time, there was a little girl named",
    "Tom and his dog went to the park. They saw",
    "One day, a big bird flew over the house and",
    "The sun was shining and the children wanted to",
)
METHODS = ("superposed", "sequential", "batched")


class MultiSeqDecoder:
    """k sequences in one llama.cpp context, decoded as one batch per step (baseline b)."""

    def __init__(self, backend: LlamaCppBackend, n_seq: int, n_ctx: int = 512) -> None:
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx  # unified cache: the k sequences share the cells (prompt once, k tokens per step)
        params.n_batch = params.n_ubatch = max(512, n_seq)
        params.n_seq_max = n_seq
        params.kv_unified = True  # one cache: the prompt's cells are shared, not copied per sequence
        params.n_threads = params.n_threads_batch = backend.config.n_threads or _threads()
        self._ctx = llama_cpp.llama_init_from_model(backend._model, params)
        if not self._ctx:
            raise TandemError("llama.cpp could not create a multi-sequence context for the batch baseline.")
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        self._batch = llama_cpp.llama_batch_init(max(512, n_seq), 0, n_seq)
        self.n_vocab = backend.n_vocab
        self.n_seq = n_seq

    def _decode(self, tokens: Sequence[int], pos: Sequence[int], seqs: Sequence[int], logits: Sequence[bool]) -> None:
        b = self._batch
        b.n_tokens = len(tokens)
        for i, (t, p, s, lg) in enumerate(zip(tokens, pos, seqs, logits, strict=True)):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, p, 1, lg
            b.seq_id[i][0] = s
        if llama_cpp.llama_decode(self._ctx, b) != 0:
            raise TandemError("llama.cpp failed to decode the multi-sequence batch.")

    def _row(self, i: int) -> np.ndarray:
        ptr = llama_cpp.llama_get_logits_ith(self._ctx, i)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def sample(self, prompt: Sequence[int], k: int, max_tokens: int, samplers: Sequence[Sampler]) -> list[list[int]]:
        llama_cpp.llama_memory_clear(self._mem, True)
        n = len(prompt)
        self._decode(prompt, range(n), [0] * n, [i == n - 1 for i in range(n)])
        first = self._row(n - 1)
        for s in range(1, k):
            llama_cpp.llama_memory_seq_cp(self._mem, 0, s, -1, -1)
        outs = [[samplers[s](first)] for s in range(k)]
        for step in range(1, max_tokens):
            self._decode([o[-1] for o in outs], [n + step - 1] * k, range(k), [True] * k)
            for s in range(k):
                outs[s].append(samplers[s](self._row(s)))
        return outs

    def close(self) -> None:
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            llama_cpp.llama_free(self._ctx)
            self._ctx = None


def _threads() -> int:
    return cpu_cores()


def draft_perplexity(target: LlamaCppBackend, prompt: Sequence[int], draft: Sequence[int]) -> float:
    """exp(mean NLL) of ``draft`` after ``prompt`` under the target's own distribution."""
    if not draft:
        return float("nan")
    target.truncate(0)
    seq = list(prompt) + list(draft)
    rows = target.evaluate(seq, logits_for=range(len(prompt) - 1, len(seq) - 1))
    target.truncate(0)
    nll = [-np.log(max(softmax(r)[t], 1e-300)) for r, t in zip(rows, draft, strict=True)]
    return float(np.exp(np.mean(nll)))


@dataclass
class MethodRun:
    seconds: list[float] = field(default_factory=list)
    ppl: list[float] = field(default_factory=list)
    distinct2: list[float] = field(default_factory=list)
    unique_frac: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    def summary(self) -> dict:
        return {"median_s": statistics.median(self.seconds), "runs": len(self.seconds),
                "ppl": float(np.nanmedian(self.ppl)), "distinct2": statistics.mean(self.distinct2),
                "unique_frac": statistics.mean(self.unique_frac), "tokens": int(statistics.median(self.tokens))}


def _run_method(method: str, target: LlamaCppBackend, multi: MultiSeqDecoder, sp: SuperposedDecoder,
                prompt: list[int], k: int, max_tokens: int, seed: int) -> tuple[float, list[list[int]]]:
    target.truncate(0)
    t0 = time.perf_counter()
    if method == "superposed":
        drafts = [d.tokens for d in sp.decode(prompt, k, max_tokens, stop_at_eog=False).drafts]
    elif method == "sequential":
        drafts = []
        for i in range(k):
            done = list(generate(target, prompt, Sampler(SamplingParams(seed=seed + i)), max_tokens=max_tokens,
                                 stop_at_eog=False))[-1]
            assert isinstance(done, DoneEvent)
            drafts.append(done.tokens)
    else:
        drafts = multi.sample(prompt, k, max_tokens, [Sampler(SamplingParams(seed=seed + i)) for i in range(k)])
    return time.perf_counter() - t0, drafts


def run_bench(target: LlamaCppBackend, ks: Sequence[int] = (2, 3, 5), max_tokens: int = 16, repeats: int = 3,
              prompts: Sequence[str] = PROMPTS, config: SuperposeConfig | None = None,
              log=lambda s: None) -> dict:
    """Median latency and draft quality per (k, method); see the module docstring."""
    sp = SuperposedDecoder(target, None, config)
    multi = MultiSeqDecoder(target, max(ks), n_ctx=min(target.n_ctx, 512))
    results: dict[int, dict[str, MethodRun]] = {k: {m: MethodRun() for m in METHODS} for k in ks}
    try:
        for rep in range(repeats):
            for pi, text in enumerate(prompts):
                prompt = target.tokenize(text, add_bos=True)
                for k in ks:
                    r0 = (rep + pi + k) % 3
                    order = METHODS[r0:] + METHODS[:r0]  # rotate who goes first
                    for method in order:
                        secs, drafts = _run_method(method, target, multi, sp, prompt, k, max_tokens,
                                                   seed=1000 * rep + 10 * pi)
                        r = results[k][method]
                        r.seconds.append(secs)
                        r.tokens.append(sum(len(d) for d in drafts))
                        if rep == 0:  # quality does not depend on timing: measure it once
                            r.ppl.extend(draft_perplexity(target, prompt, d) for d in drafts)
                            r.distinct2.append(distinct_n(drafts, 2))
                            r.unique_frac.append(len({tuple(d) for d in drafts}) / k)
                        log(f"rep {rep} prompt {pi} k={k} {method}: {secs * 1000:.0f} ms")
    finally:
        multi.close()
        target.truncate(0)
    out: dict = {"model": target.name, "max_tokens": max_tokens, "repeats": repeats, "prompts": len(prompts), "k": {}}
    for k in ks:
        s = {m: results[k][m].summary() for m in METHODS}
        s["speedup_vs_sequential"] = s["sequential"]["median_s"] / s["superposed"]["median_s"]
        s["speedup_vs_batched"] = s["batched"]["median_s"] / s["superposed"]["median_s"]
        out["k"][k] = s
    return out


def markdown_table(result: dict) -> str:
    lines = ["| k | superposed ms | (a) sequential ms | (b) batched ms | vs (a) | vs (b) | ppl sp / a / b | "
             "distinct-2 sp / a / b | unique drafts sp / a / b |", "|---|---|---|---|---|---|---|---|---|"]
    for k, s in result["k"].items():
        sp, a, b = s["superposed"], s["sequential"], s["batched"]
        lines.append(
            f"| {k} | {sp['median_s'] * 1000:.0f} | {a['median_s'] * 1000:.0f} | {b['median_s'] * 1000:.0f} | "
            f"{s['speedup_vs_sequential']:.2f}x | {s['speedup_vs_batched']:.2f}x | "
            f"{sp['ppl']:.2f} / {a['ppl']:.2f} / {b['ppl']:.2f} | "
            f"{sp['distinct2']:.2f} / {a['distinct2']:.2f} / {b['distinct2']:.2f} | "
            f"{sp['unique_frac']:.2f} / {a['unique_frac']:.2f} / {b['unique_frac']:.2f} |")
    return "\n".join(lines)


