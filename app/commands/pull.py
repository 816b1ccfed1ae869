"""`tandem pull REPO[:TAG] [FILE]`: fetch a GGUF model from the Hugging Face hub into the store."""

from __future__ import annotations

import argparse
import sys

from tandem.app.progress import Progress
from tandem.app.terminal_text import strip_controls
from tandem.models.hub import download, prepare_pull


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pull", help="download a GGUF model from the Hugging Face hub")
    p.add_argument("repo", help="repository id, e.g. ggml-org/models; REPO:TAG takes the file of that quantization "
                                "(Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF:Q4_K_M, as llama.cpp's -hf and Ollama's hf.co/ "
                                "take it); a file's hub address works too")
    p.add_argument("file", nargs="?", default=None,
                   help="GGUF file in the repository (default: the only one, else the Q4_K_M one)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Reach and list the hub behind a progress line (a slow or silent network shows as
    seconds counting, on a terminal), then download under the hub client's own bar: two
    lines redrawn in turn on one terminal line would garble each other."""
    with Progress(f"pulling {args.repo}") as progress:
        source = prepare_pull(args.repo, args.file, notify=progress.stage)
    if source.chosen is not None:
        print(f"tandem: {strip_controls(source.chosen)}", file=sys.stderr)
    path = download(source)
    if source.unreachable is not None:
        print(f"tandem: the hub cannot be reached ({source.unreachable}); "
              "using the cached copy, unchecked for updates", file=sys.stderr)
    print(strip_controls(f"{source.repo_id}/{path.name} is ready: {path}"))
    return 0
