"""Measure what a model really holds in RAM (llama.cpp, torch on CPU, onnxruntime), in a fresh process.

The memory model (:mod:`tandem.runtime.planning.memory_model`) is checked against these numbers.
A fresh subprocess keeps measurements isolated: nothing else loaded or freed in the
test process can move the figures.

What is counted: the peak of anonymous resident memory (``RssAnon``, sampled while the
workload runs) grown from just before the first model loads, plus the resident pages of the model
files themselves (llama.cpp maps them with ``MAP_POPULATE``, so the weights are fully
resident). That is weights, the KV cache, compute and output buffers as far as the
workload touches them, and the runtime's own structures (vocabulary, graph metadata,
thread pool). Shared-library code pages are not counted: how many of them a process
touches depends on the page cache (fault-around maps more pages of hot files), not on
the model, and other processes share them. The Python interpreter and imported
libraries (``import torch``, ``import onnxruntime`` for those kinds) are the baseline.
Linux only (``/proc/self/status`` and ``smaps``).

Run as ``python -m tandem.runtime.planning.memprobe SPEC.json``; prints one JSON line.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tandem.errors import child_failure
from tandem.models.python_child import module_argv


@dataclass
class ProbeModel:
    """One model to load and drive: path, its backend's config fields and a workload."""

    path: str
    n_ctx: int
    n_batch: int = 512
    flash_attn: bool = False
    type_k: str = "f16"
    type_v: str = "f16"
    n_threads: int = 1
    prompt_tokens: int = 8
    """Tokens prefilled in one ``evaluate`` call (chunked by ``n_batch`` inside)."""
    output_rows: int = 1
    """Rows of logits asked for in one verification-like call after the prompt."""
    decode_steps: int = 8
    kind: str = "llama.cpp"
    """Backend: ``llama.cpp``, ``torch`` (the torch engine on the CPU) or ``onnxruntime``
    (CPU execution provider; ``path`` is an exported folder or graph)."""


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


def _import_backends(kinds: set[str]) -> None:
    """Import what each backend kind needs before the baseline is read: ``import torch``
    or ``import onnxruntime`` (hundreds of MB) is the process's, not the model's; so is
    the ``gguf`` package (and numpy) that reading a GGUF file's header loads on first use."""
    import gguf  # noqa: F401

    import tandem.runtime.backends.llama  # noqa: F401
    if "torch" in kinds:
        import tandem.runtime.backends.torch_engine.backend  # noqa: F401
    if "onnxruntime" in kinds:
        import onnxruntime  # noqa: F401

        import tandem.runtime.backends.onnx  # noqa: F401


def _open(m: ProbeModel):
    if m.kind == "torch":
        # local: loads llama.cpp and torch only when this runs
        from tandem.runtime.backends.torch_engine.backend import TorchBackend, TorchConfig

        return TorchBackend(m.path, TorchConfig(device="cpu", n_ctx=m.n_ctx, n_batch=m.n_batch, n_threads=m.n_threads))
    if m.kind == "onnxruntime":
        # local: loads llama.cpp only when this runs
        from tandem.runtime.backends.onnx import OnnxBackend, OnnxConfig

        return OnnxBackend(m.path, OnnxConfig(device="cpu", n_ctx=m.n_ctx, n_batch=m.n_batch, n_threads=m.n_threads))
    # local: loads llama.cpp only when this runs
    from tandem.runtime.backends.llama import LlamaCppBackend
    from tandem.runtime.backends.llama_config import LlamaConfig

    cfg = LlamaConfig(n_ctx=m.n_ctx, n_batch=m.n_batch, n_threads=m.n_threads, type_k=m.type_k,
                      type_v=m.type_v, flash_attn=m.flash_attn)
    return LlamaCppBackend(m.path, cfg)


def _model_files(spec: ProbeSpec) -> list[str]:
    """The files whose mapped pages count as the models' (an ONNX folder's graphs and
    external data included)."""
    files: list[str] = []
    for m in spec.models:
        p = Path(m.path)
        files += [str(f) for f in p.iterdir() if f.is_file()] if p.is_dir() else [m.path]
    return files


class _PeakSampler:
    """Samples ``RssAnon`` every ``interval`` seconds in a thread and keeps the largest.

    llama.cpp's buffers live as long as the context, so its RSS after the workload is its
    peak; the torch engine and onnxruntime free their attention and activation
    temporaries after each forward pass, so their peak is only seen while it runs
    (torch ops release the GIL, so the sampler runs alongside them)."""

    def __init__(self, interval: float = 0.0005) -> None:

        self.interval = interval
        self.peak = _status()["RssAnon"]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, _status()["RssAnon"])

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _status()["RssAnon"])
        return self.peak


def _drive(spec: ProbeSpec) -> dict:
    _import_backends({m.kind for m in spec.models})
    files = _model_files(spec)
    before = _status()["RssAnon"]
    sampler = _PeakSampler()
    backends = [_open(m) for m in spec.models]
    loaded = _status()["RssAnon"] + _file_rss(files)
    for m, b in zip(spec.models, backends, strict=True):
        prompt_len = max(1, min(m.prompt_tokens, b.n_ctx - m.output_rows - m.decode_steps))
        ids = [(i * 7) % max(2, b.n_vocab - 3) + 3 for i in range(prompt_len)]
        b.evaluate(ids)
        if m.output_rows > 1:
            rows = m.output_rows
            b.evaluate([5] * rows, logits_for=list(range(rows)))
        for _ in range(m.decode_steps):
            b.evaluate([5])
    file_rss = _file_rss(files)
    after = _status()["RssAnon"] + file_rss
    peak = sampler.stop() + file_rss
    for b in backends:
        b.close()
    return {
        "load_bytes": loaded - before,
        "end_bytes": after - before,
        "peak_bytes": peak - before,
        "n_ctx": [b.n_ctx for b in backends],
    }


def measure(spec: ProbeSpec, timeout: float = 300.0) -> dict:
    """Run ``spec`` in a fresh Python process and return its measurements."""
    payload = json.dumps({"models": [asdict(m) for m in spec.models]})
    proc = subprocess.run(
        module_argv("tandem.runtime.planning.memprobe", "-"),
        input=payload, capture_output=True, text=True, timeout=timeout, check=False,
    )
    if proc.returncode != 0:

        raise RuntimeError(f"memory probe failed: {child_failure('memory probe child', proc.returncode, proc.stderr)}"
                           + (f"\n{proc.stderr.strip()[-2000:]}" if proc.stderr.strip() else ""))
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    raw = sys.stdin.read() if argv[0] == "-" else Path(argv[0]).read_text()
    data = json.loads(raw)
    spec = ProbeSpec(models=[ProbeModel(**m) for m in data["models"]])
    print(json.dumps(_drive(spec)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def measure_ram_bandwidth(nbytes: int = 64 * 1024**2, reps: int = 3) -> float:
    """Sustained copy bandwidth in GB/s (read + write counted), best of ``reps``: a
    ~0.1 s measurement that sets the decode-speed prediction's scale."""
    import numpy as np  # local: numpy's import (0.06 s) only when this runs

    src = np.ones(nbytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best / 1e9


def process_rss() -> int:
    """Resident set size of this process in bytes (0 where /proc is unavailable)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        # local: Unix only
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    except (ImportError, OSError):
        return 0
