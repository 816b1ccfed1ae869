"""`tandem serve`: an OpenAI-compatible server on loopback for editors and other tools."""

from __future__ import annotations

import argparse
import sys

from tandem.models.errors import TandemError

LOOPBACK = {"127.0.0.1", "::1", "localhost"}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (loopback by default)")
    p.add_argument("-m", "--model", required=True, help="GGUF file or a name from `tandem models`")
    p.add_argument("--draft", default=None, help="drafter model for speculative decoding")
    p.add_argument("--no-spec", action="store_true", help="turn speculative decoding off")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--ctx", type=int, default=None, help="context length (default: the model's, ≤ 4096)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--ngram", default=None, help="n-gram model name for n>1 drafts (default: newest matching)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting per model before 503")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from tandem.app.server.app import ServerConfig, create_app
    from tandem.app.server.models import load_model

    if not 0 < args.port < 65536:
        raise TandemError(f"Invalid port {args.port}: use 1..65535.")
    if args.host not in LOOPBACK:
        print(f"tandem: warning: listening on {args.host}: anyone who can reach this address can use the model.",
              file=sys.stderr)
    slot = load_model(args.model, draft=args.draft, speculative=not args.no_spec, n_ctx=args.ctx,
                      n_threads=args.threads, ngram_name=args.ngram)
    app = create_app([slot], ServerConfig(max_queue=args.max_queue))
    print(f"Serving {slot.name} on http://{args.host}:{args.port}/v1 (Ctrl+C to stop)", file=sys.stderr)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        slot.close()
    return 0
