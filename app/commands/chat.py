"""`tandem chat`: the terminal chat app (Textual)."""

from __future__ import annotations

import argparse

from tandem.app.commands.run import add_draft_args, add_sampling_args, sampling_from_args
from tandem.models.store import resolve_model


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="open the terminal chat app")
    p.add_argument("-m", "--model", default=None,
                   help="target GGUF file or store name (default: the first model in the store)")
    p.add_argument("--ctx", type=int, default=2048, help="context length (default 2048)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("-n", "--max-tokens", type=int, default=512, help="reply length limit for new chats")
    p.add_argument("--budget", default=None, help="host memory the chat may use, e.g. 6GiB; the memory "
                   "planner sizes target and drafter to it (see `tandem plan`)")
    p.add_argument("--history", default=None, metavar="FILE",
                   help="chat database (default: chats.sqlite3 in the Tandem data dir)")
    add_sampling_args(p)
    add_draft_args(p)
    p.set_defaults(func=run, temp=0.7)
    for action in p._actions:
        if action.dest == "temp":
            action.help = "temperature for new chats; 0 is greedy (default 0.7)"


def run(args: argparse.Namespace) -> int:
    # Textual is imported here so other commands start fast.
    from pathlib import Path

    from tandem.app.tui.app import AppConfig, TandemApp
    from tandem.app.tui.session import ChatSettings

    model = resolve_model(args.model) if args.model else None
    drafter = resolve_model(args.draft) if args.draft else None
    config = AppConfig(
        model=model,
        drafter=drafter,
        history_path=Path(args.history) if args.history else None,
        settings=ChatSettings(sampling_from_args(args), args.max_tokens, list(args.stop)),
        n_ctx=args.ctx,
        threads=args.threads,
        draft_mode=args.draft_mode,
        draft_max=args.draft_max,
        draft_len=args.draft_len,
        budget=args.budget,
        placement=args.placement,
        fast_verify=args.fast_verify,
    )
    app = TandemApp(config)
    app.run()
    return app.return_code or 0  # 1 after a crash, not a silent 0
