"""Tokens/s of the three runtimes on one cost twin: llama.cpp, the torch engine, onnxruntime.

All three load the *same* float GGUF twin (the ONNX graph is exported from it once and
cached), run in one process, and are measured in turn, round after round, with the
order rotated each round, so machine noise hits all alike; medians are reported.
Decode speed is single-token ``evaluate`` calls after a prompt (the backend itself, no
strategy); prefill speed is one ``evaluate`` of the whole prompt. The greedy tokens of
every backend are compared as a correctness check.

Run: ``python -m benchmarks.backends --params 150M --rounds 5``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from tandem.runtime.backends.protocol import Backend

PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her"


@dataclass
class BackendResult:
    name: str
    device: str
    decode_tps: list[float] = field(default_factory=list)
    prefill_tps: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    def summary(self) -> dict:
        return {
            "device": self.device,
            "decode_tps_median": round(statistics.median(self.decode_tps), 2),
            "prefill_tps_median": round(statistics.median(self.prefill_tps), 1),
            "decode_tps_runs": [round(x, 2) for x in self.decode_tps],
        }


def measure(backend: Backend, prompt: list[int], n: int) -> tuple[float, float, list[int]]:
    """(prefill tokens/s, decode tokens/s, greedy tokens) for one run."""
    backend.truncate(0)
    start = time.perf_counter()
    logits = backend.evaluate(prompt)[-1]
    prefill = len(prompt) / (time.perf_counter() - start)
    out: list[int] = []
    start = time.perf_counter()
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = backend.evaluate([out[-1]])[-1]
    decode = n / (time.perf_counter() - start)
    return prefill, decode, out


def prepare(params: str, cache: Path) -> tuple[Path, Path]:
    """(float twin GGUF, its ONNX export folder), built on first use under ``cache``."""
    from tandem.models.convert import ensure_converted
    from tandem.models.twin import ensure_twin
    from tandem.runtime.backends.onnx_export import FP32_FILE, export_onnx

    fixtures = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "models" / "tinystories-656k"
    src = ensure_converted(fixtures, cache / "twins", "f32")
    twin = ensure_twin(src, params, "f32", cache / "twins")
    onnx_dir = cache / "onnx" / f"{twin.stem}-nodedupe"
    if not (onnx_dir / FP32_FILE).exists():  # keep every padding matrix: same bytes read as the GGUF
        export_onnx(twin, onnx_dir, n_ctx=512, dedupe=False)
    return twin, onnx_dir


def run(params: str, rounds: int, n_tokens: int, cache: Path, device: str | None) -> dict:
    from tandem.runtime.backends.llama import LlamaCppBackend
    from tandem.runtime.backends.llama_config import LlamaConfig
    from tandem.runtime.backends.onnx import OnnxBackend, OnnxConfig
    from tandem.runtime.backends.torch_engine.backend import TorchBackend, TorchConfig

    twin, onnx_dir = prepare(params, cache)
    backends: dict[str, Backend] = {
        "llama.cpp": LlamaCppBackend(twin, LlamaConfig(n_ctx=512, type_k="f32", type_v="f32")),
        "torch": TorchBackend(twin, TorchConfig(device=device, n_ctx=512)),
        "onnxruntime": OnnxBackend(onnx_dir, OnnxConfig(device=device, n_ctx=512)),
    }
    results = {
        name: BackendResult(name, getattr(b, "device", "cpu") if name != "llama.cpp" else "cpu")
        for name, b in backends.items()
    }
    results["torch"].device = str(backends["torch"].device)
    prompt = backends["llama.cpp"].tokenize(PROMPT, add_bos=True)
    names = list(backends)
    for name in names:  # warm-up (first-call allocations, ORT graph optimisation)
        measure(backends[name], prompt, 2)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            prefill, decode, tokens = measure(backends[name], prompt, n_tokens)
            res = results[name]
            res.prefill_tps.append(prefill)
            res.decode_tps.append(decode)
            res.tokens = tokens
    for b in backends.values():
        b.close()
    same = len({tuple(r.tokens) for r in results.values()}) == 1
    return {
        "twin": twin.name,
        "twin_bytes": twin.stat().st_size,
        "prompt_tokens": len(prompt),
        "decode_tokens": n_tokens,
        "rounds": rounds,
        "greedy_identical": same,
        "backends": {name: res.summary() for name, res in results.items()},
        "raw": {name: asdict(res) for name, res in results.items()} if not same else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", default="150M", help="cost twin size (default 150M)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=24, help="decoded tokens per run")
    p.add_argument("--cache", type=Path, default=Path(".bench"), help="where twins and ONNX exports are kept")
    p.add_argument("--device", default=None, help="torch/onnxruntime device (default: CUDA when present)")
    args = p.parse_args(argv)
    print(json.dumps(run(args.params, args.rounds, args.tokens, args.cache, args.device), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
