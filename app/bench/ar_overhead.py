"""Plain decoding overhead: Tandem's generate loop against llama.cpp's own decode.

Three engines decode the same prompts greedily from the same GGUF file with the same
threads and context, alternating run by run so machine noise hits all alike:

* Tandem: ``generate`` with plain decoding on :class:`LlamaCppBackend` (exact config);
* native: a minimal loop of ``llama_decode`` + llama.cpp's greedy sampler through the C
  API, on a context built with Tandem's own model and context parameters -- the same
  kernels, so ``tandem - native`` per token is the Python work Tandem adds (copying and
  scanning the logits row: 151,936 floats a token for Qwen2.5, 2,048 for the toy);
  llama.cpp's own performance counters give its decode time alone (``eval``);
* llama-cpp-python's ``Llama.generate`` (its default settings, which repack weights).
"""

from __future__ import annotations

import ctypes
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import llama_cpp

from tandem.app.bench.workloads import CHAT
from tandem.errors import TandemError
from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_config import LlamaConfig, context_params, model_params
from tandem.runtime.backends.llama_vocab import load_model
from tandem.runtime.chat import chat_prompt
from tandem.runtime.generate import DoneEvent, generate
from tandem.runtime.machine import cpu_cores

PROMPTS = [
    "Once upon a time",
    "The little dog ran to the park and",
    "Lily and Tom wanted to build a big castle",
    "One day, a bird found a shiny stone",
]
"""Plain text for models without a chat template (the toy story models); chat models
get the bench's chat prompts through their template."""

N_CTX = 1024


@dataclass
class OverheadResult:
    model: str
    n_vocab: int
    tokens: int
    rounds: int
    threads: int
    tandem_tps: float
    llama_tps: float
    """llama-cpp-python's ``Llama.generate``."""
    native_tps: float
    """The C-API loop on Tandem's model and context parameters."""
    ratio: float
    """Tandem / llama-cpp-python decode speed (median of per-pair ratios)."""
    native_ratio: float
    """Tandem / native decode speed (median of per-pair ratios)."""
    tandem_ms_per_token: float
    native_ms_per_token: float
    native_eval_ms_per_token: float
    """llama.cpp's own decode time per token (its performance counters, native runs)."""
    overhead_ms_per_token: float
    """Tandem minus native per token (median of pairs): Tandem's per-token Python work."""
    identical: bool
    """Tandem's output equals the native loop's (same kernels: it must)."""
    llama_identical: bool
    """Tandem's output equals llama-cpp-python's (repacked weights may change a late token)."""

    def as_dict(self) -> dict:
        return asdict(self)


class NativeDecoder:
    """Greedy decoding through llama.cpp's C API only: decode, sample, repeat."""

    def __init__(self, path: Path, n_ctx: int, threads: int) -> None:
        cfg = LlamaConfig(n_ctx=n_ctx, n_threads=threads)
        self._model = load_model(path, model_params(cfg))
        params = context_params(cfg, n_ctx, threads)
        params.no_perf = False
        self._ctx = llama_cpp.llama_init_from_model(self._model.model, params)
        if not self._ctx:
            self._model.close()
            raise TandemError(f"llama.cpp could not create a {n_ctx}-token context for {path}.")
        self._n_batch = int(llama_cpp.llama_n_batch(self._ctx))
        self._sampler = llama_cpp.llama_sampler_init_greedy()

    def _decode(self, tokens: list[int]) -> None:
        for start in range(0, len(tokens), self._n_batch):
            chunk = tokens[start:start + self._n_batch]
            arr = (llama_cpp.llama_token * len(chunk))(*chunk)
            if llama_cpp.llama_decode(self._ctx, llama_cpp.llama_batch_get_one(arr, len(chunk))) != 0:
                raise TandemError("llama_decode failed in the native overhead loop.")

    def run(self, prompt: list[int], n: int) -> tuple[list[int], float, float]:
        """(tokens, decode tokens/s, llama.cpp's own ms per decoded token). The prompt is
        split as Tandem's prefill splits it (all but the last token, then the last), so
        both compute the same KV and the outputs can be compared token for token."""
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self._ctx), True)
        if len(prompt) > 1:
            self._decode(prompt[:-1])
        self._decode(prompt[-1:])
        llama_cpp.llama_perf_context_reset(self._ctx)
        out = [int(llama_cpp.llama_sampler_sample(self._sampler, self._ctx, -1))]
        first = time.perf_counter()
        while len(out) < n:
            self._decode(out[-1:])
            out.append(int(llama_cpp.llama_sampler_sample(self._sampler, self._ctx, -1)))
        end = time.perf_counter()
        perf = llama_cpp.llama_perf_context(self._ctx)
        eval_ms = perf.t_eval_ms / perf.n_eval if perf.n_eval else 0.0
        return out, (len(out) - 1) / (end - first) if end > first else 0.0, eval_ms

    def close(self) -> None:
        if self._ctx:
            llama_cpp.llama_sampler_free(self._sampler)
            llama_cpp.llama_free(self._ctx)
            self._ctx = ctypes.c_void_p(0)
            self._model.close()


def _llama_generate(llm: llama_cpp.Llama, prompt: list[int], n: int) -> tuple[list[int], float]:
    out: list[int] = []
    first = end = time.perf_counter()
    gen = llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True)
    try:
        for tok in gen:
            end = time.perf_counter()
            if not out:
                first = end
            out.append(int(tok))
            if len(out) >= n:
                break
    finally:
        gen.close()
    return out, (len(out) - 1) / (end - first) if end > first else 0.0


def _tandem_generate(backend: LlamaCppBackend, prompt: list[int], n: int) -> tuple[list[int], float]:
    backend.truncate(0)
    done = None
    for ev in generate(backend, prompt, Sampler(SamplingParams.greedy_params()), max_tokens=n, stop_at_eog=False):
        if isinstance(ev, DoneEvent):
            done = ev
    assert done is not None
    return done.tokens, done.stats.tokens_per_s


def prompts_for(backend: LlamaCppBackend) -> list[list[int]]:
    """Chat prompts through the model's template, or story openings for a model without one."""
    if backend.chat_template():
        return [chat_prompt(backend, [{"role": "user", "content": text}])[0] for text in CHAT]
    return [backend.tokenize(text, add_bos=True) for text in PROMPTS]


def measure_overhead(model: Path, tokens: int = 128, rounds: int = 3, threads: int | None = None,
                     prompts: int | None = None, n_ctx: int = N_CTX) -> OverheadResult:
    """Median decode rates of the three engines over ``rounds`` x the first ``prompts`` prompts."""
    threads = threads or cpu_cores()
    backend = LlamaCppBackend(model, LlamaConfig(n_ctx=n_ctx, n_threads=threads))
    n_vocab = backend.n_vocab
    native = llm = None
    try:
        native = NativeDecoder(model, n_ctx, threads)
        llm = llama_cpp.Llama(str(model), n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
                              verbose=False)
        chosen = prompts_for(backend)[:prompts]
        if max(len(p) for p in chosen) + tokens > n_ctx:
            raise TandemError(f"-n {tokens} does not fit the {n_ctx}-token context after the prompts: raise --ctx.")
        tps: dict[str, list[float]] = {"tandem": [], "native": [], "llama": []}
        ratios, native_ratios, overhead, eval_ms = [], [], [], []
        identical = llama_identical = True
        for r in range(rounds):
            for i, prompt in enumerate(chosen):
                order = ["tandem", "native", "llama"]
                shift = (r * len(chosen) + i) % 3  # rotate who goes first
                res: dict[str, tuple[list[int], float]] = {}
                for which in order[shift:] + order[:shift]:
                    if which == "tandem":
                        res[which] = _tandem_generate(backend, prompt, tokens)
                    elif which == "native":
                        out, rate, ms = native.run(prompt, tokens)
                        res[which] = (out, rate)
                        eval_ms.append(ms)
                    else:
                        res[which] = _llama_generate(llm, prompt, tokens)
                identical &= res["tandem"][0] == res["native"][0]
                llama_identical &= res["tandem"][0] == res["llama"][0]
                for k in tps:
                    tps[k].append(res[k][1])
                ratios.append(res["tandem"][1] / res["llama"][1])
                native_ratios.append(res["tandem"][1] / res["native"][1])
                overhead.append(1e3 / res["tandem"][1] - 1e3 / res["native"][1])
    finally:
        backend.close()
        if native is not None:
            native.close()
        if llm is not None:
            llm.close()
    med = {k: statistics.median(v) for k, v in tps.items()}
    return OverheadResult(
        model=model.name, n_vocab=n_vocab, tokens=tokens, rounds=rounds, threads=threads,
        tandem_tps=med["tandem"], llama_tps=med["llama"], native_tps=med["native"],
        ratio=statistics.median(ratios), native_ratio=statistics.median(native_ratios),
        tandem_ms_per_token=1e3 / med["tandem"], native_ms_per_token=1e3 / med["native"],
        native_eval_ms_per_token=statistics.median(eval_ms), overhead_ms_per_token=statistics.median(overhead),
        identical=identical, llama_identical=llama_identical,
    )
