"""What a `tandem run` process holds before any model: measured once per machine, cached.

A budget is the process's peak resident memory as the OS reports it (``/usr/bin/time
-f %M``, ``VmHWM``), so the plan counts the interpreter, the libraries `tandem run`
imports and the llama.cpp code it will fault in — not as a constant fitted on one
machine, but measured here: a child process imports exactly what `tandem run` imports
(every sub-command's parser, the llama.cpp backend, speculative decoding), and its
resident size plus the llama.cpp code not yet resident (an upper bound of what decoding
faults in, :func:`tandem.runtime.planning.memprobe.unresident_code`) is the baseline.

The figure depends on the machine (libraries, page size, allocator) and on the code and
package versions, so it is cached under the user cache dir keyed by all of them
(:func:`machine_key`) and written atomically. The memory bandwidth behind the
predicted decode speed is measured in the same child (best of several copies) and
cached with it, so identical `tandem plan` calls print identical speeds.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import random
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from tandem.errors import TandemError, child_failure
from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.models.paths import cache_dir, write_cache_file
from tandem.models.python_child import module_argv
from tandem.runtime.backends.selfcheck import write_tiny_llama
from tandem.runtime.machine import cache_key, code_stamp, machine_id, software_id
from tandem.runtime.planning.llama_sizes import ContextSetup, LlamaSizes, work_buffer
from tandem.runtime.planning.memprobe import process_rss
from tandem.runtime.planning.shapes import padded_ctx, shape_from_gguf
from tandem.runtime.speculative.drafters.chain import ChainDrafter
from tandem.runtime.speculative.drafters.lookup import PromptLookupDrafter
from tandem.runtime.speculative.drafters.suffix import SuffixDrafter, global_cache

BASELINE_VERSION = 5
CLI_MODULE = "tandem.app.cli"
"""`tandem`'s entry point; its full parser imports every sub-command module (a command
imports its own alone: this is the most any of them holds)."""

RUN_PATH_MODULES = (
    "tandem.runtime.backends.llama",
    "tandem.runtime.planning.planner",
    "tandem.runtime.planning.placement",
    "tandem.runtime.planning.calibration",
    "tandem.runtime.speculative.loop",
    "tandem.runtime.speculative.overlap",
    "tandem.runtime.generate",
    "tandem.runtime.speculative.drafters.model",
    "tandem.runtime.backends.opener",
    "tandem.runtime.streaming_text",
    "tandem.kernels.sampling",
    "numpy.random",
    "numpy.ctypeslib",
    "gguf",
)
"""Modules a GGUF `tandem run` imports beyond the command line's parsers (the full
parser imports every sub-command module: :func:`tandem.app.cli.build_parser`)."""


@dataclass(frozen=True)
class MachineBaseline:
    rss: int
    """Resident bytes of a process that imported what `tandem run` imports."""
    code: int
    """llama.cpp library code mapped but not yet resident (faulted in while running)."""
    bandwidth_gbs: float
    """Sustained memory copy bandwidth (GB/s), best of several measurements."""
    draft_index_per_token: float
    """Resident bytes per context token of the model-free drafters' index (suffix
    trie and prompt lookup; Python objects), at its worst: tokens that never repeat."""
    llama_context: int
    """Resident bytes a llama.cpp model and context take beyond the items the memory
    model prices from llama.cpp's own sizes (context structures, the thread pool and
    its work buffers, first-decode allocations): measured by running a tiny model."""
    llama_context_note: str = ""
    """Empty when :attr:`llama_context` was measured; otherwise why it is
    :data:`LLAMA_CONTEXT_FALLBACK` (the tiny model's run died: a signal by name)."""

    @property
    def total(self) -> int:
        return self.rss + self.code


def machine_key() -> str:
    """This machine and software (:mod:`tandem.runtime.machine`): hardware, kernel,
    Python, package versions and Tandem's code."""
    return cache_key(machine_id(), software_id(), code_stamp(), BASELINE_VERSION)


def cache_file() -> Path:
    return cache_dir() / "machine-baseline" / f"{machine_key()}.json"


LLAMA_CONTEXT_FALLBACK = 16 * 1024**2
""":attr:`MachineBaseline.llama_context` when the tiny model could not be run: above
what was measured on every machine so far (about 1.5 MB on 2-core x86-64 CPUs)."""


def _measure() -> MachineBaseline:
    """The child's figures; if it died of a signal, once more without the tiny llama.cpp
    model (a native crash there must not stop every run: that one figure then falls
    back to :data:`LLAMA_CONTEXT_FALLBACK`, and the note says why)."""
    global _PENDING
    proc, _PENDING = _PENDING or _spawn(), None
    returncode, out, err = _wait(proc)
    note = ""
    if returncode is not None and returncode < 0:
        note = child_failure("tiny llama.cpp model's run", returncode, err)
        returncode, out, err = _wait(_spawn(skip_llama=True))
    if returncode != 0:
        why = child_failure("process baseline child", returncode, err)
        raise TandemError(f"Could not measure this machine's process baseline: {why}")
    figures = json.loads(out.strip().splitlines()[-1])
    return MachineBaseline(**figures, llama_context_note=note)


def _wait(proc: subprocess.Popen) -> tuple[int | None, str, str]:
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return proc.returncode, out, err


SKIP_LLAMA_ENV = "TANDEM_BASELINE_SKIP_LLAMA"


def _spawn(*, skip_llama: bool = False) -> subprocess.Popen:
    env = {**os.environ, SKIP_LLAMA_ENV: "1"} if skip_llama else None
    return subprocess.Popen(module_argv("tandem.runtime.planning.baseline"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env)


def measure_soon() -> None:
    """Start measuring in the background when nothing is cached, so the child runs
    beside whatever else a first run measures (:func:`machine_baseline` then waits for
    it instead of starting one)."""
    global _PENDING
    if _CACHED is None and _PENDING is None and not cache_file().exists():
        _PENDING = _spawn()


_CACHED: MachineBaseline | None = None
_PENDING: subprocess.Popen | None = None


def machine_baseline() -> MachineBaseline:
    """This machine's baseline: from the cache, else measured in a child and cached."""
    global _CACHED
    if _CACHED is not None:
        return _CACHED
    path = cache_file()
    try:
        _CACHED = MachineBaseline(**json.loads(path.read_text()))
        return _CACHED
    except (OSError, ValueError, TypeError):
        pass
    _CACHED = _measure()
    write_cache_file(path, json.dumps(asdict(_CACHED)))
    return _CACHED


def _child() -> int:
    """Import what `tandem run` imports, then report resident memory and bandwidth."""

    # The command line is what a run's process really imports; it is named here as data
    # (the module whose import cost is measured), not used: runtime/ never calls into app/.
    importlib.import_module(CLI_MODULE).build_parser()
    for name in RUN_PATH_MODULES:
        importlib.import_module(name)
    import llama_cpp  # local: llama.cpp's libraries load only when this runs

    llama_cpp.llama_backend_init()
    from tandem.runtime.planning.memprobe import measure_ram_bandwidth, process_rss, unresident_code

    rss, code = process_rss(), unresident_code()
    # Measured after the baseline is read: their objects and buffers are not part of it.
    context = LLAMA_CONTEXT_FALLBACK if os.environ.get(SKIP_LLAMA_ENV) else _llama_context_overhead()
    per_token = _draft_index_per_token()
    bandwidth = measure_ram_bandwidth(reps=7)
    print(json.dumps({"rss": rss, "code": code, "bandwidth_gbs": round(bandwidth, 1),
                      "draft_index_per_token": round(per_token, 1), "llama_context": context}))
    return 0


def _rss_anon() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def _return_freed_memory() -> None:
    """Hand the heap's freed pages back to the system (glibc's ``malloc_trim``), so that
    memory a measurement then allocates shows as growth; without it, what the size probe
    had just freed was sometimes reused and the context measured 0 bytes (1 run in 6)."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to hand back
        ctypes.CDLL(None).malloc_trim(0)


def _llama_context_overhead() -> int:
    """Run a tiny Llama model (random weights, written here) as `tandem run` runs a
    model — the backend with every core, a prompt filling its context, a verification
    of 9 rows, decode steps — and return the anonymous memory it took beyond the KV
    cache, compute buffer, logits and runtime the memory model prices for it."""

    # local: loads llama.cpp only when this runs
    from tandem.runtime.backends.llama import LlamaCppBackend
    from tandem.runtime.backends.llama_config import LlamaConfig

    n_ctx = rows = 0
    with tempfile.TemporaryDirectory(prefix="tandem-baseline-") as folder:
        path = write_tiny_llama(Path(folder) / "tiny.gguf")
        shape = shape_from_gguf(path)
        n_ctx, rows = shape.n_ctx_train, 9
        sizes = LlamaSizes(path, persist=False)
        try:
            compute = sizes.context(ContextSetup(n_ctx, n_ctx, outputs=rows)).compute
            runtime = sizes.runtime
        finally:
            sizes.close()
        _return_freed_memory()  # what LlamaSizes freed would otherwise be reused unseen
        before = _rss_anon()
        # Host memory is what is measured: no GPU, even on a CUDA build (whose big batches
        # would otherwise go to the card and its CUDA buffers, priced elsewhere).
        backend = LlamaCppBackend(path, LlamaConfig(n_ctx=n_ctx, n_batch=n_ctx, gpu_devices=False))
        try:
            backend.evaluate([3 + i % 250 for i in range(n_ctx - rows - 8)])
            backend.evaluate([5] * rows, logits_for=list(range(rows)))
            for _ in range(4):
                backend.evaluate([7])
            grown = _rss_anon() - before
        finally:
            backend.close()
    work = work_buffer(n_ctx, padded_ctx(n_ctx), shape.n_embd, shape.n_ff, shape.n_head)
    priced = shape.kv_bytes_per_token() * n_ctx + compute + 2 * 4 * rows * shape.n_vocab + runtime + work
    return max(0, grown - priced)


def _draft_index_per_token(n: int = 2048) -> float:
    """Resident growth per token of the model-free drafters over ``n`` never-repeating
    tokens: a prompt, then drafting rounds as generation does (propose, commit). The
    growth is linear: 2048 tokens gave 2,402 bytes a token on the AVX2 EPYC, 4096 gave
    2,400, in 0.10 s against 0.15 s of a new machine's first run."""


    rng = random.Random(0)
    tokens = rng.sample(range(1 << 20), n)
    drafter = ChainDrafter([SuffixDrafter(global_cache=global_cache("baseline-probe:1048576")),
                            PromptLookupDrafter()])
    sampler = Sampler(SamplingParams(temperature=0))
    before = process_rss()
    prompt = n - 256
    drafter.propose(tokens[:prompt], 8, sampler)
    for end in range(prompt + 8, n + 1, 8):
        drafter.commit(tokens[:end], 8)
        drafter.propose(tokens[:end], 8, sampler)
    return (process_rss() - before) / n


if __name__ == "__main__":
    sys.exit(_child())
