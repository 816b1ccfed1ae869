"""A long chat through the server, turn by turn, as a chat client sends it: the time to
first token and the prompt tokens found cached at each turn.

A client sends the whole conversation every turn; a server with several slots must send
each turn to the slot that holds the turns before it, or it prefills the conversation
again. ``tandem serve`` runs with its default slots (as many as fit, at most 4); with
``--base DIR`` (a checkout of another version of the code) both servers run, one after
the other, ``--rounds`` times. Synthetic chat: random words, about 150 tokens a user
turn, greedy replies of ``--reply`` tokens.

Run: ``python -m benchmarks.server_turns --model qwen2.5-coder-1.5b --threads 2 [--base OLD_CHECKOUT]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.long_chat import chat
from benchmarks.server_load import model_path, served

SHOWN = (1, 5, 10, 15, 20)


def turns(url: str, n: int, reply_tokens: int) -> list[tuple[float, int, int]]:
    """(TTFT s, prompt tokens, cached tokens) for each of ``n`` turns of one conversation."""
    users = [m["content"] for m in chat(2 * n, seed=1) if m["role"] == "user"]
    messages: list[dict] = []
    out = []
    with httpx.Client(base_url=url, timeout=600) as c:
        for text in users[:n]:
            messages.append({"role": "user", "content": text})
            body = {"messages": messages, "max_tokens": reply_tokens, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}
            start, first, reply, usage = time.perf_counter(), None, "", {}
            with c.stream("POST", "/v1/chat/completions", json=body) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        usage = event["usage"]
                    for choice in event.get("choices", []):
                        piece = choice["delta"].get("content")
                        if piece:
                            first = first or time.perf_counter() - start
                            reply += piece
            messages.append({"role": "assistant", "content": reply})
            out.append((first or 0.0, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]))
    return out


def serve(model: str, args, env: dict[str, str]) -> list[tuple[float, int, int]]:
    with served(model, 18090, ["--threads", str(args.threads)], env) as url:
        return turns(url, args.turns, args.reply)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="a GGUF path or a real-models.sh name")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--reply", type=int, default=32, help="tokens per reply")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--base", default=None, help="a checkout of another version of the code to run beside")
    args = ap.parse_args()
    model = model_path(args.model)
    arms = {"current": dict(os.environ)}
    if args.base:
        shim = Path(tempfile.mkdtemp(prefix="tandem-base-"))
        (shim / "tandem").symlink_to(Path(args.base).resolve())
        arms = {"base": {**os.environ, "PYTHONPATH": str(shim)}, **arms}
    runs: dict[str, list[list[tuple[float, int, int]]]] = {name: [] for name in arms}
    for r in range(args.rounds):
        for name, env in arms.items():
            runs[name].append(serve(model, args, env))
            print(f"round {r} {name}: " + ", ".join(f"turn {t}: {runs[name][-1][t - 1][0]:.2f} s "
                                                   f"({runs[name][-1][t - 1][2]}/{runs[name][-1][t - 1][1]} cached)"
                                                   for t in SHOWN if t <= args.turns), flush=True)
    print("\n| turn | prompt tokens | " + " | ".join(f"{n}: TTFT, cached" for n in arms) + " |")
    print("|---|---|" + "---|" * len(arms))
    for t in (t for t in SHOWN if t <= args.turns):
        cells = []
        for name in arms:
            ttfts = [run[t - 1][0] for run in runs[name]]
            cached = statistics.median(run[t - 1][2] for run in runs[name])
            spread = f" ({min(ttfts):.2f}-{max(ttfts):.2f})" if len(ttfts) > 1 else ""
            cells.append(f"{statistics.median(ttfts):.2f} s{spread}, {cached:.0f}")
        prompt = runs[next(iter(arms))][0][t - 1][1]
        print(f"| {t} | {prompt} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
