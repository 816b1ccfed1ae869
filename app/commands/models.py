"""`tandem models`: list the local model store."""

from __future__ import annotations

import argparse
import json

from tandem.app.terminal_text import strip_controls
from tandem.models.paths import models_dir
from tandem.models.store import list_models


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list models in the local store")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    models = list_models()
    if args.json:
        print(json.dumps([m.as_dict() for m in models], indent=2))
        return 0
    if not models:
        print("No models yet. Pull one with `tandem pull OWNER/REPO:Q4_K_M`, or put GGUF files in")
        print(f"{models_dir()} or in a folder listed in TANDEM_MODEL_PATH.")
        return 0
    # file names and GGUF headers are anybody's text: no escape sequence reaches the terminal
    rows = [(strip_controls(m.name), m.size_bytes, strip_controls(m.architecture or "?"), strip_controls(str(m.path)))
            for m in models]
    width = max(len(name) for name, *_ in rows)
    for name, size, arch, path in rows:
        print(f"{name:<{width}}  {size / 2**20:8.1f} MiB  {arch:<10}  {path}")
    return 0
