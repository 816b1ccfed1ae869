"""Real-shape GGUF headers for planning tests: Qwen2.5-7B's dimensions and tensor list,
Q4_K_M's bytes, the real Qwen2.5 tokenizer, and no weights (a sparse file of zeros, a few
MB on disk; ``benchmarks.gpu_shapes --sparse``). The planner reads headers and asks
llama.cpp for sizes from metadata only, so it plans such a file as it would the real one."""

from __future__ import annotations

from pathlib import Path

from benchmarks.gpu_shapes import write


def qwen7b_header(folder: Path, vocab_from: Path) -> Path:
    """Qwen2.5-7B shapes as a planning stand-in, written once into ``folder``."""
    out = folder / "qwen2.5-7b-shape-q4_k_m.gguf"
    if not out.exists():
        write("qwen2.5-7b", str(out), str(vocab_from), sparse=True)
    return out
