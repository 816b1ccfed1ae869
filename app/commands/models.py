"""`tandem models`: list the local model store."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tandem.app.terminal_text import strip_controls
from tandem.errors import TandemError
from tandem.models.gguf_file import GGUFInfo, inspect_gguf
from tandem.models.paths import models_dir
from tandem.models.store import list_models
from tandem.runtime.planning.shapes import shape_from_gguf


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list models in the local store")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def quantization(info: GGUFInfo) -> str:
    """How the file's weights are stored, as llama.cpp and the hub name it (``Q4_K_M``): its
    ``general.file_type``, else the type of most of its block weights, as the memory planner
    reads it (``F32``)."""
    import gguf  # local: the package's enums only when models are listed

    code = info.metadata.get("general.file_type")
    try:
        if isinstance(code, int):
            return gguf.LlamaFileType(code).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        return shape_from_gguf(info).weight_type.upper()
    except ValueError:  # a type this gguf package does not know
        return "?"


def quantization_of(path: Path) -> str:
    try:
        return quantization(inspect_gguf(path))
    except TandemError:  # a damaged file is still listed (`tandem rm` must reach it)
        return "?"


def run(args: argparse.Namespace) -> int:
    models = list_models()
    if args.json:
        print(json.dumps([{**m.as_dict(), "quantization": quantization_of(m.path)} for m in models], indent=2))
        return 0
    if not models:
        print("No models yet. Pull one with `tandem pull OWNER/REPO:Q4_K_M`, or put GGUF files in")
        print(f"{models_dir()} or in a folder listed in TANDEM_MODEL_PATH.")
        return 0
    # file names and GGUF headers are anybody's text: no escape sequence reaches the terminal
    rows = [(strip_controls(m.name), m.size_bytes, strip_controls(m.architecture or "?"), quantization_of(m.path),
             strip_controls(str(m.path))) for m in models]
    width = max(len(name) for name, *_ in rows)
    for name, size, arch, quant, path in rows:
        print(f"{name:<{width}}  {size / 2**20:8.1f} MiB  {arch:<10}  {quant:<8}  {path}")
    return 0
