"""Which of llama.cpp's lossless CPU configurations runs a GGUF fastest on this machine.

Two configurations compute every token as plain decoding does (greedy speculative output
stays the target's own): the weights as stored (:attr:`LlamaConfig.exact`; verify calls
of up to 7 tokens) and the weights repacked for llama.cpp's extra CPU kernels
(:attr:`LlamaConfig.repack`; verify calls of up to 3). Which is faster depends on the
CPU and the quantization: repacked decoding is 1.34x on AMD Zen 5 (AVX-512) at 2
threads, and equal on an AVX2-only AMD, where the weights as stored prefill 1.18x faster.
llama-cpp-python repacks by default, so the repacked configuration is never slower than
it; the weights as stored are kept where they are not slower than repacked at decoding
nor at prompt processing (their longer verify calls make drafting cheaper).

The measurement (a prompt of one ubatch and a few decode steps after it, the two
configurations loaded in turn, twice each in the order exact, repacked, repacked, exact) is
taken once per model file, thread count, machine and software, in a child process
started in the background when a run that found none closes its engine: that first run
uses the weights as stored, later runs use the choice. It is cached like every
per-machine measurement (:func:`tandem.runtime.machine.cache_key`).
``TANDEM_KERNEL_PROBE=off`` disables the background measurement (tests).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from tandem.models.paths import cache_dir, write_cache_file
from tandem.models.python_child import module_argv
from tandem.runtime.machine import cache_key, file_version, machine_id, software_id

KERNELS_VERSION = 2
"""2: prompts timed at a ubatch, not 64 tokens; decoding within :data:`DECODE_TIE` is a tie."""
PROBE_PROMPT = 512
"""Tokens of the timed prompt: one ubatch, a prompt long enough for its speed to matter
(64 tokens take about a second either way). The configurations rank differently by
prompt length: on an AVX2-only AMD EPYC (1.5B Q4_K_M, 2 threads) the repacked weights
processed 64-token prompts 1.1x faster than the weights as stored, and 900-token prompts
0.82x (the weights as stored 1.19x the peer's), so a probe timed at 64 kept the slower
configuration for long prompts."""
PROBE_WARMUP = 16
"""Tokens of the untimed warm-up prompt after each load (page faults, thread pools)."""
PROBE_STEPS = 16
"""Timed one-token decode steps per load, after the prompt (a real context's attention)."""
PROBE_ROUNDS = 2
"""Loads of each configuration, ordered exact, repacked, repacked, exact so a drift of the
machine's speed weighs on both alike."""
DECODE_TIE = 0.03
"""Decoding speeds this close are a tie: both read every weight once a token, and a
probe of a few steps on a busy laptop cannot rank them closer. On a tie, prompt speed
decides. (Some machines cannot rank them at all: on the AVX2 EPYC above, whose speed
drifts 10-20 % run to run, three measurements put repacked decoding at 0.90x, 1.02x and
1.13x the weights as stored, while the weights as stored processed long prompts
1.15-1.33x faster in all three; either choice decodes level with the peer there.)"""
PROBE_STALE_S = 600
"""A probe's lock older than this is from a probe that died: another may start."""
PLAUSIBLE_RATIO = 3.0
"""Decoding reads every weight once a token in either configuration, so one cannot decode
this many times faster than the other: a probe that says so was timed while something
else held the cores (one cached on a 2-core Zen 5 read "repacked decodes at 0.00x": 3.4 s a
token), and is not kept; the next run measures again. Prompt processing is not bounded
(batched kernels, AMX on Intel, can be several times faster repacked)."""


@dataclass(frozen=True)
class KernelChoice:
    """The configuration chosen for one model, threads and machine, and why."""

    repack: bool
    why: str
    threads: int
    measured: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per configuration (``exact``, ``repacked``): decode seconds per token and prompt
    seconds per token, medians of the probe's rounds."""
    pending: bool = False
    """Nothing measured yet: the default (weights as stored), and a probe is due."""

    def as_dict(self) -> dict:
        out = {"config": "repacked" if self.repack else "exact", "why": self.why}
        if self.measured:
            out["measured"] = self.measured
        return out


def choice_path(model: str | os.PathLike[str], threads: int) -> Path | None:
    try:
        version = file_version(model)
    except OSError:
        return None
    return cache_dir() / "llama-kernels" / f"{cache_key(version, threads, machine_id(), software_id(), KERNELS_VERSION)}.json"


def cached_choice(model: str | os.PathLike[str], threads: int) -> KernelChoice | None:
    path = choice_path(model, threads)
    if path is None:
        return None
    try:
        data = json.loads(path.read_text())
        return KernelChoice(bool(data["repack"]), str(data["why"]), threads, dict(data.get("measured") or {}))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def choose_kernels(model: str | os.PathLike[str], threads: int) -> KernelChoice:
    """The cached choice for ``model`` at ``threads``, else the weights as stored with a
    probe due (:func:`measure_later`)."""
    return cached_choice(model, threads) or KernelChoice(
        False, "weights as stored (the default) until this machine is measured: measured after this run",
        threads, pending=True)


def decide(exact: dict[str, float], repacked: dict[str, float], threads: int) -> KernelChoice:
    """Repacked unless the weights as stored are as fast at decoding (within
    :data:`DECODE_TIE`) and at least as fast at prompt processing (``decode_s``,
    ``prompt_s``: seconds per token, lower is faster). Repacked is the peer's own
    configuration, so either way neither speed falls under the peer's beyond the tie."""
    measured = {"exact": exact, "repacked": repacked}
    d = exact["decode_s"] / repacked["decode_s"]  # > 1: repacked decodes faster
    p = exact["prompt_s"] / repacked["prompt_s"]
    figures = f"repacked decodes at {d:.2f}x and processes prompts at {p:.2f}x the weights as stored"
    if d <= 1.0 + DECODE_TIE and p <= 1.0:
        tie = " (equal decoding)" if d > 1.0 else ""
        return KernelChoice(False, f"measured here: {figures}; exact kept{tie}: longer verify calls", threads, measured)
    return KernelChoice(True, f"measured here: {figures}", threads, measured)


def plausible(choice: KernelChoice) -> bool:
    """Whether ``choice`` measured both configurations decoding within
    :data:`PLAUSIBLE_RATIO` of each other (see there)."""
    exact, repacked = choice.measured.get("exact", {}), choice.measured.get("repacked", {})
    if exact.get("decode_s", 0) <= 0 or repacked.get("decode_s", 0) <= 0:
        return False
    return 1 / PLAUSIBLE_RATIO <= repacked["decode_s"] / exact["decode_s"] <= PLAUSIBLE_RATIO


def probe(model: str | os.PathLike[str], threads: int, *, rounds: int = PROBE_ROUNDS,
          prompt_tokens: int = PROBE_PROMPT, steps: int = PROBE_STEPS) -> KernelChoice:
    """Time both configurations of ``model``, one loaded at a time (never more memory
    than a run of the model takes), each loaded ``rounds`` times in the order exact,
    repacked, repacked, exact, ..., and decide."""
    order = [repack for r in range(rounds) for repack in ((False, True) if r % 2 == 0 else (True, False))]
    times: dict[bool, dict[str, list[float]]] = {False: {"decode_s": [], "prompt_s": []},
                                                 True: {"decode_s": [], "prompt_s": []}}
    for repack in order:
        prompt_s, decode_s = _time_once(model, threads, repack, prompt_tokens, steps)
        times[repack]["prompt_s"].append(prompt_s)
        times[repack]["decode_s"].append(decode_s)
    medians = {repack: {k: round(statistics.median(v), 6) for k, v in t.items()} for repack, t in times.items()}
    return decide(medians[False], medians[True], threads)


def _time_once(model: str | os.PathLike[str], threads: int, repack: bool, prompt_tokens: int,
               steps: int) -> tuple[float, float]:
    """One load of one configuration: seconds per token of a ``prompt_tokens`` prompt, then
    of ``steps`` one-token steps after it, after an untimed warm-up."""
    # local: loads llama.cpp only when this runs
    from tandem.runtime.backends.llama import LlamaCppBackend
    from tandem.runtime.backends.llama_config import LlamaConfig

    text = "def quicksort(items):\n    if len(items) <= 1:\n        return items\n"
    with LlamaCppBackend(model, LlamaConfig(n_ctx=prompt_tokens + steps + 8, n_threads=threads, repack=repack)) as b:
        tokens = b.tokenize(text * (1 + 2 * (prompt_tokens + steps) // max(1, len(b.tokenize(text)))))
        prompt, after = tokens[:prompt_tokens], tokens[prompt_tokens:prompt_tokens + steps]
        warm = prompt[:PROBE_WARMUP]
        b.evaluate(warm[:-1])
        b.evaluate(warm[-1:])  # one decode step too
        b.truncate(0)
        start = time.perf_counter()
        b.evaluate(prompt)
        prompt_s = (time.perf_counter() - start) / len(prompt)
        start = time.perf_counter()
        for token in after:
            b.evaluate([token])
        return prompt_s, (time.perf_counter() - start) / max(1, len(after))


def remember(model: str | os.PathLike[str], threads: int, choice: KernelChoice) -> None:
    path = choice_path(model, threads)
    if path is not None:
        write_cache_file(path, json.dumps(asdict(replace(choice, pending=False))))


def measure_later(model: str | os.PathLike[str], threads: int) -> bool:
    """Start the probe in a detached, low-priority child (at most one per model and
    threads at a time); returns whether one was started."""
    if os.environ.get("TANDEM_KERNEL_PROBE", "").lower() in ("off", "0", "no"):
        return False
    path = choice_path(model, threads)
    if path is None:
        return False
    lock = path.with_suffix(".probing")
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        if lock.exists() and time.time() - lock.stat().st_mtime < PROBE_STALE_S:
            return False
        lock.write_text(str(os.getpid()))
        subprocess.Popen(module_argv("tandem.runtime.backends.llama_kernels", str(model), str(threads)),
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True, env={**os.environ, "TANDEM_KERNEL_PROBE": "off"})
    except OSError:
        return False
    return True


def _child(model: str, threads: int) -> int:
    path = choice_path(model, threads)
    try:
        os.nice(10)  # after the user's run, and behind whatever they do next
        choice = probe(model, threads)
        if not plausible(choice):
            return 1  # timed beside other work: measured again after the next run
        remember(model, threads, choice)
        return 0
    except Exception:  # noqa: BLE001 - best effort: measured again next time
        return 1
    finally:
        if path is not None:
            path.with_suffix(".probing").unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1], int(sys.argv[2])))
