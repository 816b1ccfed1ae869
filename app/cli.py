"""`tandem` command line: one sub-command per module, each with a ``register`` function."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from tandem.errors import TandemError
from tandem.models.extras import EXTRA_OF, MissingExtra, missing_message

_COMMANDS = "tandem.app.commands"
COMMANDS: dict[str, str] = {
    "run": f"{_COMMANDS}.run",
    "chat": f"{_COMMANDS}.chat",
    "chats": f"{_COMMANDS}.chats",
    "models": f"{_COMMANDS}.models",
    "pull": f"{_COMMANDS}.pull",
    "rm": f"{_COMMANDS}.rm",
    "ngram": f"{_COMMANDS}.ngram",
    "serve": f"{_COMMANDS}.serve",
    "rpc-server": f"{_COMMANDS}.rpc_server",
    "convert": f"{_COMMANDS}.convert",
    "quantize": f"{_COMMANDS}.convert",
    "twin": f"{_COMMANDS}.twin",
    "plan": f"{_COMMANDS}.plan",
    "export-onnx": f"{_COMMANDS}.export_onnx",
    "distill": f"{_COMMANDS}.distill",
    "bench": f"{_COMMANDS}.bench",
    "moefy": f"{_COMMANDS}.moefy",
}
"""Each sub-command and the module that adds it (its ``register(subparsers)``), in the
order ``tandem --help`` lists them."""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser. Given the sub-command being run, only its module is
    imported: the others import the runtime (numpy, llama.cpp), 0.65 s on a slow CPU
    before ``tandem chat`` could draw anything. Without one (``tandem --help``, a typo),
    every sub-command is there to be listed."""
    parser = argparse.ArgumentParser(
        prog="tandem",
        description="On-device LLM chat and autocomplete: a target model runs in tandem with a tiny drafter.",
    )
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = [COMMANDS[command]] if command in COMMANDS else list(dict.fromkeys(COMMANDS.values()))
    for name in modules:
        importlib.import_module(name).register(sub)
    return parser


def command_named(argv: Sequence[str]) -> str | None:
    """The sub-command ``argv`` runs: its first word that is not an option (``tandem``'s
    own options, ``--version`` and ``--help``, take no value)."""
    return next((word for word in argv if not word.startswith("-")), None)


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
    """Run one sub-command; Ctrl+C at any point (the sub-command is still being imported
    for the first 0.1-0.3 s) is one line and status 130, never a traceback."""
    try:
        return _run(argv)
    except KeyboardInterrupt:
        print("\ntandem: interrupted", file=sys.stderr)
        return 130


def _run(argv: Sequence[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(command_named(argv))
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
