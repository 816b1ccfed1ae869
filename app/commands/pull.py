"""`tandem pull REPO [FILE]`: fetch a GGUF model from the Hugging Face hub into the store."""

from __future__ import annotations

import argparse

from tandem.models.store import pull


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pull", help="download a GGUF model from the Hugging Face hub")
    p.add_argument("repo", help="repository id, e.g. ggml-org/models")
    p.add_argument("file", nargs="?", default=None, help="GGUF file in the repository")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    path = pull(args.repo, args.file)
    print(f"{args.repo}/{path.name} is ready: {path}")
    return 0
