"""Measure what a llama.cpp model really holds in RAM, in a fresh process.

The memory model (:mod:`tandem.runtime.memory_model`) is checked against these numbers.
A fresh subprocess keeps measurements isolated: nothing else loaded or freed in the
test process can move the figures.

What is counted: the growth of the process's resident set (``VmRSS``) from just
before the first model loads to the high-water mark (``VmHWM``, reset through
``/proc/self/clear_refs`` first) after the workload ran. That is weights (llama.cpp
maps the file with ``MAP_POPULATE``, so the mapped pages are resident), the KV cache
(cleared at creation, so every page is touched), the compute and output buffers as far
as the workload touches them, and the runtime's own structures (vocabulary, graph
metadata, thread pool). The Python interpreter and imported libraries are the
baseline and are not counted. Linux only (it reads ``/proc/self/status``).

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


def _drive(spec: ProbeSpec) -> dict:
    from tandem.runtime.llama_backend import LlamaConfig, LlamaCppBackend

    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # reset VmHWM to the current RSS
    before = _status()["VmRSS"]
    backends = []
    for m in spec.models:
        cfg = LlamaConfig(
            n_ctx=m.n_ctx, n_batch=m.n_batch, n_threads=m.n_threads, type_k=m.type_k,
            type_v=m.type_v, flash_attn=m.flash_attn,
        )
        backends.append(LlamaCppBackend(m.path, cfg))
    loaded = _status()["VmRSS"]
    for m, b in zip(spec.models, backends, strict=True):
        prompt_len = max(1, min(m.prompt_tokens, b.n_ctx - m.output_rows - m.decode_steps))
        ids = [(i * 7) % max(2, b.n_vocab - 3) + 3 for i in range(prompt_len)]
        b.evaluate(ids)
        if m.output_rows > 1:
            rows = m.output_rows
            b.evaluate([5] * rows, logits_for=list(range(rows)))
        for _ in range(m.decode_steps):
            b.evaluate([5])
    after = _status()
    for b in backends:
        b.close()
    return {
        "load_bytes": loaded - before,
        "peak_bytes": after["VmHWM"] - before,
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
