"""`tandem chat`: the terminal chat app (Textual)."""

from __future__ import annotations

import argparse

from tandem.app.commands.engine_flags import MODEL_HELP, add_engine_flags, spec_from_args
from tandem.app.commands.sampling_flags import add_sampling_args, sampling_from_args
from tandem.errors import TandemError
from tandem.models.store import resolve_model


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="open the terminal chat app")
    p.add_argument("-m", "--model", default=None,
                   help=MODEL_HELP + " (default: the first model in the store)")
    p.add_argument("-n", "--max-tokens", type=int, default=512, help="reply length limit for new chats")
    p.add_argument("--history", default=None, metavar="FILE",
                   help="chat database (default: chats.sqlite3 in the Tandem data dir)")
    add_engine_flags(p)
    add_sampling_args(p)
    p.set_defaults(func=run, temp=0.7)
    for action in p._actions:
        if action.dest == "temp":
            action.help = "temperature for new chats; 0 is greedy (default 0.7)"


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    # local: Textual and the app load only when the chat runs (`tandem --help` imports every command module)
    from tandem.app.tui.app import AppConfig, TandemApp
    from tandem.app.tui.session import ChatSettings

    if args.max_tokens < 1:
        raise TandemError(f"-n/--max-tokens must be at least 1, got {args.max_tokens}.")
    model = resolve_model(args.model) if args.model else None
    # The engine settings of the command line; the chat app sets target and drafter per chat.
    spec = spec_from_args(args, model=model or Path())
    config = AppConfig(
        model=model,
        drafter=spec.drafter,
        history_path=Path(args.history) if args.history else None,
        settings=ChatSettings(sampling_from_args(args), args.max_tokens, list(args.stop)),
        n_ctx=spec.n_ctx,
        threads=spec.threads,
        draft_mode=spec.draft_mode,
        draft_max=spec.draft_max,
        draft_len=spec.draft_len,
        budget=args.budget,
        placement=spec.placement,
        fast_verify=spec.fast_verify,
        engine=spec,
    )
    app = TandemApp(config)
    app.run()
    return app.return_code or 0  # 1 after a crash, not a silent 0
