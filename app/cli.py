"""`tandem` command line: one sub-command per module, each with a ``register`` function."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from tandem.errors import TandemError
from tandem.models.extras import EXTRA_OF, MissingExtra, missing_message

COMMAND_MODULES = [
    "tandem.app.commands.run",
    "tandem.app.commands.chat",
    "tandem.app.commands.chats",
    "tandem.app.commands.models",
    "tandem.app.commands.pull",
    "tandem.app.commands.rm",
    "tandem.app.commands.ngram",
    "tandem.app.commands.serve",
    "tandem.app.commands.rpc_server",
    "tandem.app.commands.convert",
    "tandem.app.commands.twin",
    "tandem.app.commands.plan",
    "tandem.app.commands.export_onnx",
    "tandem.app.commands.distill",
    "tandem.app.commands.bench",
    "tandem.app.commands.moefy",
]
"""Modules that add sub-commands; each defines ``register(subparsers)``."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem",
        description="On-device LLM chat and autocomplete: a target model runs in tandem with a tiny drafter.",
    )
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


class _Version(argparse.Action):
    """``--version``: the package's version, looked up only when asked (every other run
    would pay for reading the install's metadata)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print the version and exit", **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from tandem.runtime.machine import tandem_version  # local: only for --version

        print(f"tandem {tandem_version()}")
        parser.exit()


def main(argv: Sequence[str] | None = None) -> int:
    """Run one sub-command; Ctrl+C at any point (the sub-commands are still being imported
    for the first 0.3 s) is one line and status 130, never a traceback."""
    try:
        return _run(argv)
    except KeyboardInterrupt:
        print("\ntandem: interrupted", file=sys.stderr)
        return 130


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except TandemError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] not in EXTRA_OF:  # not an optional extra: a real bug
            raise
        # A path that forgot to ask `require` first still gets the one line naming the extra.
        print(f"tandem: error: {missing_message(f'tandem {args.command}', EXTRA_OF[exc.name.partition('.')[0]], exc.name)}", file=sys.stderr)
        return MissingExtra.exit_code
    except BrokenPipeError:
        return 0
    except OSError as exc:  # a read-only or missing data folder, a full disk: one line, no traceback
        where = f": {exc.filename}" if exc.filename else ""
        print(f"tandem: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
