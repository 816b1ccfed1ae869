"""`tandem ngram`: build the n-gram tables autocomplete re-scores its drafts with.

The tables come only from text the user points at (files, folders, their chat
history), tokenized with the model's own tokenizer, and live under the data dir.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from pathlib import Path

from tandem.app.progress import Progress
from tandem.errors import TandemError
from tandem.models.ngram import NgramModel, default_path, ngram_dir, tokenizer_fingerprint
from tandem.models.store import resolve_model

MAX_FILE_BYTES = 8 * 2**20
SKIP_DIRS = {".git", ".hg", ".svn", "node_modules", "__pycache__", ".venv", "venv", ".mypy_cache"}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ngram", help="build n-gram tables for autocomplete from your own text")
    nsub = p.add_subparsers(dest="ngram_command", metavar="ACTION")
    b = nsub.add_parser("build", help="count 1..6-grams in text files (folders are walked)")
    b.add_argument("paths", nargs="*", help="text files or folders")
    b.add_argument("-m", "--model", required=True, help="the model whose tokenizer the tables use")
    b.add_argument("--name", default="default", help="name of the n-gram model (default: default)")
    b.add_argument("--chats", action="store_true", help="also use your saved chat history")
    b.add_argument("--min-count", type=int, default=1, help="drop n-grams seen fewer times (smaller file)")
    b.set_defaults(func=run_build)
    ls = nsub.add_parser("list", help="list built n-gram models")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=run_list)
    p.set_defaults(func=lambda args: (p.print_help(), 0)[1])


def iter_text_files(paths: list[str]) -> Iterator[tuple[str, str]]:
    """(name, text) for every readable UTF-8 text file under ``paths``; binaries skipped."""
    for raw in paths:
        root = Path(raw).expanduser()
        if not root.exists():
            raise TandemError(f"No such file or folder: {raw}")
        files = [root] if root.is_file() else sorted(
            f for f in root.rglob("*") if f.is_file() and not (SKIP_DIRS & set(f.relative_to(root).parts))
        )
        for f in files:
            if f.stat().st_size > MAX_FILE_BYTES:
                continue
            data = f.read_bytes()
            if b"\0" in data[:4096]:
                continue
            try:
                yield str(f), data.decode("utf-8")
            except UnicodeDecodeError:
                continue


def iter_chat_texts() -> Iterator[tuple[str, str]]:
    # local: `tandem --help` imports every command module; this loads only when the command runs
    from tandem.app.history.database import History, default_path

    if not default_path().exists():
        return
    with History() as history:
        for chat in history.list_chats():
            for m in history.messages(chat.id):
                if m.content.strip():
                    yield f"chat:{chat.id}", m.content


def run_build(args: argparse.Namespace) -> int:
    # local: `tandem --help` imports every command module; this loads only when the command runs
    from tandem.runtime.backends.llama import LlamaCppBackend
    from tandem.runtime.backends.llama_config import LlamaConfig

    if not args.paths and not args.chats:
        raise TandemError("Give at least one file or folder (or --chats) to build the n-gram model from.")
    if args.min_count < 1:
        raise TandemError("--min-count must be at least 1.")
    start = time.perf_counter()
    with (Progress(f"building the n-gram model {args.name!r}") as progress,
          LlamaCppBackend(resolve_model(args.model), LlamaConfig(n_ctx=64)) as tok):
        fingerprint = tokenizer_fingerprint(tok.n_vocab, tok.token_bytes)
        path = default_path(args.name, fingerprint)
        docs, sources = [], []
        texts = list(iter_text_files(args.paths)) + (list(iter_chat_texts()) if args.chats else [])
        for done, (name, text) in enumerate(texts, 1):
            progress.step("tokenizing", done, len(texts))
            ids = tok.tokenize(text, add_bos=False)
            if ids:
                docs.append(ids)
                sources.append(name)
        if not docs:
            raise TandemError("No text found in the given paths (binary and empty files are skipped).")
        progress.stage("counting n-grams")
        model = NgramModel.build(docs, tok.n_vocab, fingerprint=fingerprint, min_count=args.min_count,
                                 sources=sorted(set(sources))[:1000])
    model.save(path)
    took = time.perf_counter() - start
    print(f"Built n-gram model {args.name!r}: {model.n_tokens} tokens from {len(docs)} texts, "
          f"{model.nbytes() / 2**20:.1f} MiB, in {took:.1f} s -> {path}")
    return 0


def run_list(args: argparse.Namespace) -> int:
    rows = []
    for f in sorted(ngram_dir().glob("*.npz")):
        try:
            meta = NgramModel.load(f).meta
        except TandemError as exc:
            meta = {"error": str(exc)}
        rows.append({"path": str(f), "size_bytes": f.stat().st_size, **meta})
    if args.json:
        print(json.dumps(rows, indent=2))
    elif not rows:
        print("No n-gram models yet. Build one with `tandem ngram build PATH... -m MODEL`.")
    else:
        for r in rows:
            print(f"{Path(r['path']).name}  {r['size_bytes'] / 2**20:6.1f} MiB  {r.get('n_tokens', '?')} tokens")
    return 0
