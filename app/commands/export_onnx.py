"""`tandem export-onnx`: write a model as an ONNX decoder-with-past graph (fp32, int8)."""

from __future__ import annotations

import argparse
import json

from tandem.app.progress import Progress
from tandem.models.extras import require
from tandem.models.store import resolve_model


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export-onnx",
        help="export a GGUF file or Hugging Face folder to ONNX (decoder with past KV)",
        description="Export a Llama-family model to an ONNX graph with KV-cache inputs and outputs, "
        "runnable by onnxruntime (CUDA when present, else CPU) as a target or drafter.",
    )
    p.add_argument("model", help="GGUF file, Hugging Face checkpoint folder, or a name from `tandem models`")
    p.add_argument("-o", "--output", required=True, help="folder to write model.onnx and its tokenizer to")
    p.add_argument("--int8", action="store_true", help="also write model.int8.onnx (int8 weights, dynamic quantization)")
    p.add_argument("--ctx", type=int, default=None, help="longest context the graph supports (default: the model's)")
    p.add_argument("--json", action="store_true", help="print the written files as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    require("tandem export-onnx", "torch,onnx", "torch", "onnx", *(["onnxruntime"] if args.int8 else []))
    # The exporter imports torch at module level: imported here, after the check, so
    # `tandem` itself starts without it.
    from tandem.runtime.backends.onnx_export import export_onnx

    with Progress(f"exporting {args.model} to ONNX"):
        written = export_onnx(resolve_model(args.model), args.output, int8=args.int8, n_ctx=args.ctx)
    if args.json:
        print(json.dumps({"files": [str(p) for p in written], "sizes": [p.stat().st_size for p in written]}))
    else:
        for p in written:
            print(f"wrote {p} ({p.stat().st_size / 2**20:.1f} MiB)")
    return 0
