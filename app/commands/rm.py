"""`tandem rm NAME`: delete a model from the local store (as `tandem models` lists it)."""

from __future__ import annotations

import argparse
import sys

from tandem.app.terminal_text import strip_controls
from tandem.errors import TandemError
from tandem.models.store import remove_model, store_entry


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rm", help="delete a model from the local store")
    p.add_argument("model", help="its name in `tandem models`, or its path")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask first")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    entry = store_entry(args.model)
    what = f"{strip_controls(entry.name)} ({entry.size_bytes / 2**20:.1f} MiB, {strip_controls(str(entry.path))})"
    if not args.yes:
        if not sys.stdin.isatty():
            raise TandemError(f"Not deleting {what} without a question answered: add --yes.")
        if input(f"Delete {what}? [y/N] ").strip().lower() not in ("y", "yes"):
            print("Nothing deleted.")
            return 1
    freed = remove_model(entry)
    print(f"Deleted {strip_controls(entry.name)}: {freed / 2**20:.1f} MiB freed.")
    return 0
