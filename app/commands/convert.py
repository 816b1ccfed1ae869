"""`tandem convert` (Hugging Face Llama checkpoint -> GGUF) and `tandem quantize` (GGUF -> Q8_0/Q4_K_M)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tandem.app.progress import Progress
from tandem.models.convert import convert_hf
from tandem.models.extras import require
from tandem.models.quantize import FILE_TYPES, quantize_gguf


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="convert a Hugging Face Llama checkpoint folder to GGUF")
    p.add_argument("src", help="folder with config.json, *.safetensors and tokenizer.json")
    p.add_argument("-o", "--output", required=True, help="GGUF file to write")
    p.add_argument("--type", default="f32", choices=list(FILE_TYPES), help="tensor type (default f32)")
    p.set_defaults(func=run_convert)

    q = sub.add_parser("quantize", help="quantize an F32/F16 GGUF with llama.cpp's quantizer")
    q.add_argument("src", help="F32 or F16 GGUF file")
    q.add_argument("-o", "--output", required=True, help="GGUF file to write")
    q.add_argument("--type", default="q8_0", choices=list(FILE_TYPES), help="target type (default q8_0)")
    q.add_argument("--threads", type=int, default=0, help="quantizer threads (0: all cores)")
    q.set_defaults(func=run_quantize)


def _report(out: Path, start: float) -> None:
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB) in {time.perf_counter() - start:.1f} s")


def run_convert(args: argparse.Namespace) -> int:
    require("tandem convert", "torch", "safetensors", "torch")  # reads safetensors shards as torch tensors
    start = time.perf_counter()
    with Progress(f"converting {args.src}") as progress:
        progress.stage("tensors")
        out = convert_hf(args.src, args.output, args.type, progress=progress.advance)
    _report(out, start)
    return 0


def run_quantize(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    with Progress(f"quantizing {args.src} to {args.type}"):
        out = quantize_gguf(args.src, args.output, args.type, args.threads)
    _report(out, start)
    return 0
