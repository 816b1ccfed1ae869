"""The physics speculative decoding runs on: the target's verify-cost curve c(k) and each
drafter's cost per drafted token, measured directly (``tandem bench --cost-curve``).

c(k) = time of one target call over k+1 tokens / time of a one-token call, at a real
context (a chat prompt already in the cache), for Tandem's exact llama.cpp configuration
(``LlamaConfig(exact=True)``, what every Tandem run uses) and the fast one (weights
repacked for llama.cpp's batched kernels, what llama-cpp-python uses by default). Both
are open at once and measured alternately, so machine load hits both alike.

A drafter's cost is its one-token call over the target's (exact). With acceptance a and
draft length k, a round yields about (1 - a^(k+1)) / (1 - a) tokens for
c(k) + k * cost: that ratio over 1 is the most any policy can gain.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tandem.app.bench.workloads import CHAT
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_config import LlamaConfig
from tandem.runtime.chat import chat_prompt
from tandem.runtime.machine import cpu_cores


@dataclass
class CostCurves:
    model: str
    threads: int
    reps: int
    context: int
    """Tokens in the cache when the calls are timed."""
    t1_ms: dict[str, float]
    """One-token call, per configuration (exact / fast)."""
    curves: dict[str, list[float]]
    """c(k) for k = 0..k_max, per configuration."""
    drafter_cost: dict[str, float] = field(default_factory=dict)
    """Drafter file name -> its one-token call over the target's (exact configuration)."""

    def as_dict(self) -> dict:
        return asdict(self)


def _call_ms(backend: LlamaCppBackend, base: int, tokens: list[int]) -> float:
    """One timed call over ``tokens`` after the first ``base`` cached tokens."""
    backend.truncate(base)
    start = time.perf_counter()
    backend.evaluate(tokens, logits_for=range(len(tokens)))
    return (time.perf_counter() - start) * 1e3


def measure_costs(model: Path, *, drafters: list[Path] = (), threads: int | None = None, k_max: int = 8,
                  reps: int = 5, n_ctx: int = 1024, n_gpu_layers: int = 0) -> CostCurves:
    """``n_gpu_layers``: llama.cpp's GPU layers of every model (-1: all; 0: the CPU)."""
    threads = threads or cpu_cores()
    engines = {name: LlamaCppBackend(model, LlamaConfig(n_ctx=n_ctx, n_threads=threads, exact=exact,
                                                        n_gpu_layers=n_gpu_layers))
               for name, exact in (("exact", True), ("fast", False))}
    opened = list(engines.values())
    try:
        for path in drafters:
            opened.append(LlamaCppBackend(path, LlamaConfig(n_ctx=n_ctx, n_threads=threads,
                                                            n_gpu_layers=n_gpu_layers)))
        prompt = chat_prompt(engines["exact"], [{"role": "user", "content": CHAT[0]}])[0]
        follow = engines["exact"].tokenize(" The table stores each key in a bucket chosen by its hash value." * 4)
        times: dict[str, dict[int, list[float]]] = {name: {k: [] for k in range(k_max + 1)} for name in engines}
        for b in engines.values():
            b.evaluate(prompt)
        for _ in range(reps):
            for k in range(k_max + 1):
                for name, b in engines.items():  # alternate, so load hits both alike
                    times[name][k].append(_call_ms(b, len(prompt), follow[: k + 1]))
        t1 = {name: statistics.median(t[0]) for name, t in times.items()}
        curves = {name: [round(statistics.median(t[k]) / t1[name], 3) for k in range(k_max + 1)]
                  for name, t in times.items()}
        costs = {}
        for d in opened[2:]:
            ids = chat_prompt(d, [{"role": "user", "content": CHAT[0]}])[0]
            d.evaluate(ids)
            one = [_call_ms(d, len(ids), ids[-1:]) for _ in range(reps * 3)]
            costs[d.name] = round(statistics.median(one) / t1["exact"], 3)
        return CostCurves(model.name, threads, reps, len(prompt), {k: round(v, 2) for k, v in t1.items()},
                          curves, costs)
    finally:
        for b in opened:
            b.close()


def format_costs(res: CostCurves) -> str:
    k_max = len(next(iter(res.curves.values()))) - 1
    lines = [f"{res.model}: {res.threads} thread(s), {res.context} tokens in the cache, medians of {res.reps}",
             f"{'config':8s} {'t1 ms':>7s}  " + " ".join(f"c({k})".rjust(6) for k in range(k_max + 1))]
    for name, curve in res.curves.items():
        lines.append(f"{name:8s} {res.t1_ms[name]:7.2f}  " + " ".join(f"{c:6.2f}" for c in curve))
    for name, cost in res.drafter_cost.items():
        lines.append(f"drafter {name}: {cost:.3f} of the target's one-token call per drafted token")
    return "\n".join(lines)
