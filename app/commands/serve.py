"""`tandem serve`: an OpenAI-compatible server on loopback for editors and other tools."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

from tandem.app.commands.engine_flags import MODEL_HELP, add_engine_flags, spec_from_args
from tandem.errors import TandemError

LOOPBACK = {"127.0.0.1", "::1", "localhost"}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (loopback by default)")
    p.add_argument("-m", "--model", required=True, help=MODEL_HELP)
    p.add_argument("--no-spec", action="store_true", help="turn speculative decoding off (--draft-mode off)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--ngram", default=None, help="n-gram model name for n>1 drafts (default: newest matching)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting per model before 503")
    p.add_argument("-np", "--parallel", type=int, default=None, metavar="N",
                   help="requests decoded at once, in one batch (as llama-server's -np): N KV sequences, each "
                        "with the full context (default: as many as fit the memory budget, at most 4, each "
                        "at the context one alone would get; 1 with a --draft model, which serves one)")
    p.add_argument("--cache-reuse", type=int, default=0, metavar="N",
                   help="/infill: reuse cached runs of at least N tokens that moved in the prompt, shifting "
                        "their KV instead of recomputing it (as llama-server's --cache-reuse; llama.vim "
                        "suggests 256; 0: off). Close to, not bit-identical with, a fresh evaluation")
    p.add_argument("--send-timeout", type=float, default=30.0, metavar="S",
                   help="end a streamed reply whose client has read nothing for S seconds")
    p.add_argument("--request-log", default=None, metavar="FILE",
                   help="append one JSON line per request (model, tokens, timings, acceptance; never text) "
                        "to FILE (default: logs/requests.jsonl in the data dir; 'off' for none)")
    p.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every request (default: $TANDEM_API_KEY); "
                        "needed to listen on a non-loopback address")
    p.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="let web pages from ORIGIN (e.g. https://app.example, or *) call the server; "
                        "by default only loopback pages may")
    add_engine_flags(p)
    p.set_defaults(func=run)


def check_args(args: argparse.Namespace) -> None:
    """Refuse unsafe or impossible settings before anything is loaded."""
    if not 0 < args.port < 65536:
        raise TandemError(f"Invalid port {args.port}: use 1..65535.")
    if args.max_queue < 1:
        raise TandemError(f"--max-queue must be at least 1, got {args.max_queue}.")
    if args.parallel is not None and not 1 <= args.parallel <= 64:
        raise TandemError(f"--parallel must be between 1 and 64, got {args.parallel}.")
    if args.api_key is not None and len(args.api_key) < 8:
        raise TandemError("--api-key must be at least 8 characters.")
    if args.no_spec and args.draft:
        raise TandemError("--draft needs speculative decoding on (drop --no-spec).")
    if args.host not in LOOPBACK and not args.api_key:
        raise TandemError(f"Listening on {args.host} makes the model reachable from other machines: "
                          "set an --api-key (or TANDEM_API_KEY) too, or listen on 127.0.0.1.")


def request_log_path(value: str | None) -> Path | None:
    # local: `tandem --help` imports every command module; this loads only when the command runs
    from tandem.app.server.request_log import default_path

    if value is None:
        return default_path()
    return None if value == "off" else Path(value).expanduser()


def open_server(args: argparse.Namespace):
    """The model slot and the ASGI app ``args`` describe (the model is loaded here)."""
    # local: `tandem --help` imports every command module; this loads only when the command runs
    from tandem.app.progress import Progress
    from tandem.app.server.asgi import ServerConfig, create_app
    from tandem.app.server.loaded_models import load_model

    spec = spec_from_args(args)
    if args.no_spec:
        spec = replace(spec, draft_mode="off")
    with Progress(f"loading {args.model}") as progress:
        progress.stage("choosing parallel slots")
        spec = replace(spec, parallel=args.parallel or default_parallel(spec))
        slot = load_model(spec, ngram_name=args.ngram, max_queue=args.max_queue, notify=progress.stage,
                          on_load=progress.fraction)
    for note in slot.notes:
        print(f"tandem: {note}", file=sys.stderr)
    try:
        app = create_app([slot], ServerConfig(max_queue=args.max_queue, api_key=args.api_key,
                                              cache_reuse=args.cache_reuse, send_timeout_s=args.send_timeout,
                                              allow_origins=tuple(o.rstrip("/") for o in args.allow_origin),
                                              request_log=request_log_path(args.request_log)))
    except BaseException:
        slot.close()
        raise
    return slot, app


def default_parallel(spec) -> int:
    """``--parallel``'s default: what the memory plan fits (see
    :func:`tandem.runtime.planning.planner.parallel_for`) for a GGUF target in llama.cpp
    without a drafter model; 1 otherwise (a drafter serves one sequence; the torch engine,
    onnxruntime and RPC targets decode one)."""
    # local: `tandem --help` imports every command module; this loads only when the command runs
    from tandem.runtime.engine.checks import target_engine

    if spec.rpc or spec.drafter is not None or target_engine(spec) != "llama.cpp":
        return 1
    # local: `tandem --help` imports every command module; this loads only when the command runs
    from tandem.runtime.planning.planner import parallel_for

    return parallel_for(spec.target, spec.budget, spec.n_ctx, vram=spec.vram, threads=spec.threads,
                        draft_max=spec.draft_max, kv_type=spec.kv_type)


def run(args: argparse.Namespace) -> int:
    # local: `tandem --help` imports every command module; this loads only when the command runs
    from tandem.app.server.listen import ListenConfig, bind, uvicorn_server

    check_args(args)
    sock = bind(args.host, args.port)  # a port in use fails here, before the model is loaded
    try:
        slot, app = open_server(args)
        try:
            server = uvicorn_server(app, ListenConfig(args.host, args.port), on_shutdown=[slot.worker.stop_all])
            print(f"Serving {slot.name} on http://{args.host}:{args.port}/v1 with {len(slot.lanes)} parallel "
                  f"slot{'s' if len(slot.lanes) > 1 else ''} (Ctrl+C to stop)", file=sys.stderr, flush=True)
            server.run(sockets=[sock])
        finally:
            slot.close()
    finally:
        sock.close()
    print("Stopped: the model is closed.", file=sys.stderr, flush=True)
    return 0
