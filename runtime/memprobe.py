"""Measure what a llama.cpp model really holds in RAM, in a fresh process.

The memory model (:mod:`tandem.runtime.memory_model`) is checked against these numbers.
A fresh subprocess keeps measurements isolated: nothing else loaded or freed in the
test process can move the figures.

What is counted: anonymous resident memory (``RssAnon``) grown from just before the
first model loads to just after the workload ran, plus the resident pages of the model
files themselves (llama.cpp maps them with ``MAP_POPULATE``, so the weights are fully
resident). That is weights, the KV cache, compute and output buffers as far as the
workload touches them, and the runtime's own structures (vocabulary, graph metadata,
thread pool). Shared-library code pages are not counted: how many of them a process
touches depends on the page cache (fault-around maps more pages of hot files), not on
the model, and other processes share them. The Python interpreter and imported
libraries are the baseline. Linux only (``/proc/self/status`` and ``smaps``).

Run as ``python -m tandem.runtime.memprobe SPEC.json``; prints one JSON line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class ProbeModel:
    """One model to load and drive: path, its ``LlamaConfig`` fields and a workload."""

    path: str
    n_ctx: int
    n_batch: int = 512
    flash_attn: bool = True
    type_k: str = "f16"
    type_v: str = "f16"
    n_threads: int = 1
    prompt_tokens: int = 8
    """Tokens prefilled in one ``evaluate`` call (chunked by ``n_batch`` inside)."""
    output_rows: int = 1
    """Rows of logits asked for in one verification-like call after the prompt."""
    decode_steps: int = 8


@dataclass
class ProbeSpec:
    models: list[ProbeModel] = field(default_factory=list)


def _status() -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            parts = value.split()
            if len(parts) == 2 and parts[1] == "kB":
                out[key] = int(parts[0]) * 1024
    return out


def _file_rss(paths: list[str]) -> int:
    """Resident bytes of this process's mappings of ``paths`` (from ``/proc/self/smaps``)."""
    wanted = {str(Path(p).resolve()) for p in paths}
    total, current = 0, False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:  # a mapping header line
                current = len(head) >= 6 and head[5] in wanted
            elif current and head and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


RUNTIME_LIBRARIES = ("libllama", "libggml")
"""Shared libraries whose code pages a budgeted process still faults in after planning."""


def unresident_code(names: tuple[str, ...] = RUNTIME_LIBRARIES) -> int:
    """Bytes of executable mappings of ``names`` not resident yet in this process.

    The memory model leaves library code out (how much of it a process touches depends
    on the page cache, see the module docstring), but a budget is a promise about the
    whole resident set: kernels first used while decoding fault in megabytes of
    llama.cpp code after the plan was made (measured: ~2 MiB during a long chat, ~2 MiB
    while loading). Everything mapped and not yet resident is the upper bound the
    planner reserves. 0 where ``/proc/self/smaps`` is unavailable."""
    total, size, current = 0, 0, False
    try:
        with open("/proc/self/smaps") as fh:
            for line in fh:
                head = line.split()
                if head and "-" in head[0] and len(head) >= 5:  # a mapping header line
                    current = len(head) >= 6 and "x" in head[1] and any(n in head[5] for n in names)
                elif current and head and head[0] == "Size:":
                    size = int(head[1]) * 1024
                elif current and head and head[0] == "Rss:":
                    total += max(0, size - int(head[1]) * 1024)
    except OSError:
        return 0
    return total


def _drive(spec: ProbeSpec) -> dict:
    from tandem.runtime.llama_backend import LlamaConfig, LlamaCppBackend

    before = _status()["RssAnon"]
    backends = []
    for m in spec.models:
        cfg = LlamaConfig(
            n_ctx=m.n_ctx, n_batch=m.n_batch, n_threads=m.n_threads, type_k=m.type_k,
            type_v=m.type_v, flash_attn=m.flash_attn,
        )
        backends.append(LlamaCppBackend(m.path, cfg))
    loaded = _status()["RssAnon"] + _file_rss([m.path for m in spec.models])
    for m, b in zip(spec.models, backends, strict=True):
        prompt_len = max(1, min(m.prompt_tokens, b.n_ctx - m.output_rows - m.decode_steps))
        ids = [(i * 7) % max(2, b.n_vocab - 3) + 3 for i in range(prompt_len)]
        b.evaluate(ids)
        if m.output_rows > 1:
            rows = m.output_rows
            b.evaluate([5] * rows, logits_for=list(range(rows)))
        for _ in range(m.decode_steps):
            b.evaluate([5])
    after = _status()["RssAnon"] + _file_rss([m.path for m in spec.models])
    for b in backends:
        b.close()
    return {
        "load_bytes": loaded - before,
        "peak_bytes": after - before,
        "n_ctx": [b.n_ctx for b in backends],
    }


def measure(spec: ProbeSpec, timeout: float = 300.0) -> dict:
    """Run ``spec`` in a fresh Python process and return its measurements."""
    payload = json.dumps({"models": [asdict(m) for m in spec.models]})
    proc = subprocess.run(
        [sys.executable, "-m", "tandem.runtime.memprobe", "-"],
        input=payload, capture_output=True, text=True, timeout=timeout, check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"memory probe failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    raw = sys.stdin.read() if argv[0] == "-" else Path(argv[0]).read_text()
    data = json.loads(raw)
    spec = ProbeSpec(models=[ProbeModel(**m) for m in data["models"]])
    print(json.dumps(_drive(spec)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
