"""Parallel slots under load: chat clients streaming plus an editor typing, against
`tandem serve --parallel 1` (one worker) and `--parallel N`, alternating.

For each server it measures, all on 127.0.0.1:

* **chat only**: ``--clients`` clients streaming chat replies back to back for
  ``--seconds``; aggregate tokens per second (completion tokens over wall time);
* **idle /infill TTFT**: the editor alone, one streamed /infill at a time; TTFT is the
  time to the first streamed event, as the editor sees it;
* **chat + editor**: the same clients plus an editor sending an /infill every
  ``--keystroke-ms`` (a newer keystroke supersedes an unanswered one, as llama.vim's
  do); /infill TTFT p50/p95 and the aggregate chat tokens per second.

Run from the repository root::

    .venv/bin/python -m benchmarks.server_load --model qwen2.5-coder-0.5b --threads 2 --parallel 4 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

QUESTIONS = [
    "Explain what a hash map is and how it handles collisions.",
    "Write a Python function that merges two sorted lists, with a docstring.",
    "Describe the difference between a process and a thread.",
    "List the steps to bake bread at home.",
    "What are the main causes of the French Revolution?",
    "Write a bash one-liner that counts lines in all .py files.",
]

FILE_HEAD = '''import json
from pathlib import Path


def load_config(path: Path) -> dict:
    """Read the JSON configuration at ``path``."""
    with path.open() as f:
        return json.load(f)


def save_config(path: Path, config: dict) -> None:
'''
TYPED = "    text = json.dumps(config, indent=2, sort_keys=True)\n    path.write_text(text)\n"


def model_path(name: str) -> str:
    if os.path.exists(name):
        return name
    out = subprocess.run(["bash", str(Path(__file__).resolve().parents[2] / "shared/fixtures/real-models.sh")],
                         capture_output=True, text=True, check=True).stdout
    paths = dict(line.split("\t", 1) for line in out.splitlines() if "\t" in line)
    return paths[name].strip()


@dataclass
class Phase:
    tokens: int = 0
    seconds: float = 0.0
    ttft_ms: list[float] = field(default_factory=list)
    superseded: int = 0

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")


async def chat_client(c: httpx.AsyncClient, i: int, deadline: float, phase: Phase, max_tokens: int) -> None:
    n = i
    while time.monotonic() < deadline:
        body = {"messages": [{"role": "user", "content": QUESTIONS[n % len(QUESTIONS)]}], "max_tokens": max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        async with c.stream("POST", "/v1/chat/completions", json=body,
                            headers={"authorization": f"Bearer chat-{i}"}) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                ev = json.loads(line[5:])
                if ev.get("usage"):
                    phase.tokens += ev["usage"]["completion_tokens"]
        n += 1


async def one_infill(c: httpx.AsyncClient, typed: int, phase: Phase) -> None:
    body = {"input_prefix": FILE_HEAD + TYPED[:typed], "input_suffix": "\n\n\ndef main() -> None:\n    pass\n",
            "n_predict": 24, "stream": True, "temperature": 0}
    start = time.monotonic()
    async with c.stream("POST", "/infill", json=body, headers={"authorization": "Bearer editor"}) as r:
        if r.status_code == 499:
            phase.superseded += 1
            return
        first = True
        async for line in r.aiter_lines():
            if first and line.startswith("data:"):
                phase.ttft_ms.append((time.monotonic() - start) * 1000)
                first = False


async def editor(c: httpx.AsyncClient, deadline: float, phase: Phase, keystroke_s: float) -> None:
    tasks = []
    typed = 10
    while time.monotonic() < deadline:
        tasks.append(asyncio.create_task(one_infill(c, typed, phase)))
        typed = typed + 1 if typed < len(TYPED) else 10
        await asyncio.sleep(keystroke_s)  # the typist's pace
    await asyncio.gather(*tasks)


async def idle_infill(c: httpx.AsyncClient, n: int) -> Phase:
    phase = Phase()
    for k in range(n):
        await one_infill(c, 10 + k, phase)
    return phase


async def measure(url: str, args) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        # chat alone first: once an editor has been seen, chat leaves it a slot
        chat = Phase()
        start = time.monotonic()
        deadline = start + args.seconds
        await asyncio.gather(*(chat_client(c, i, deadline, chat, args.max_tokens) for i in range(args.clients)))
        chat.seconds = time.monotonic() - start
        await idle_infill(c, 2)  # warm-up
        idle = await idle_infill(c, args.idle_infills)
        mixed, edits = Phase(), Phase()
        start = time.monotonic()
        deadline = start + args.seconds
        await asyncio.gather(editor(c, deadline, edits, args.keystroke_ms / 1000),
                             *(chat_client(c, i, deadline, mixed, args.max_tokens) for i in range(args.clients)))
        mixed.seconds = time.monotonic() - start
        health = (await c.get("/health")).json()
    batch = next(iter(health["models"].values())).get("batch") or {}
    rows_per_decode = batch["rows"] / batch["decodes"] if batch.get("decodes") else 1.0
    return {"rows_per_decode": rows_per_decode, "merged_decodes": float(batch.get("merged", 0)),"idle_ttft_p50": pct(idle.ttft_ms, 0.5), "idle_ttft_p95": pct(idle.ttft_ms, 0.95),
            "chat_tok_s": chat.tok_s, "mixed_tok_s": mixed.tok_s,
            "infill_ttft_p50": pct(edits.ttft_ms, 0.5), "infill_ttft_p95": pct(edits.ttft_ms, 0.95),
            "infills": len(edits.ttft_ms), "superseded": edits.superseded}


@contextlib.contextmanager
def served(model: str, port: int, options: list[str], env: dict[str, str] | None = None) -> Iterator[str]:
    """``tandem serve -m model`` with ``options`` on ``port`` (request log off), its URL
    once ``/health`` answers; stopped on exit. Shared by the server benchmarks."""
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "tandem.app.cli", "serve", "-m", model, "--port", str(port),
                                 *options, "--request-log", "off"], stdout=subprocess.DEVNULL, stderr=err, env=env)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 600
            while True:
                if proc.poll() is not None:
                    err.seek(0)
                    raise SystemExit(f"server exited: {err.read()[-2000:]}")
                try:
                    httpx.get(f"{url}/health", timeout=2)
                    break
                except httpx.TransportError:
                    if time.monotonic() > deadline:
                        raise SystemExit("server did not come up") from None
                    time.sleep(0.2)
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def serve(model: str, parallel: int, args) -> dict:
    options = ["--threads", str(args.threads), "--ctx", str(args.ctx), "--parallel", str(parallel)]
    with served(model, 18000 + parallel, options) as url:
        return asyncio.run(measure(url, args))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="a GGUF path or a real-models.sh name")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--parallel", type=int, default=4, help="the candidate's slots (the baseline has 1)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--keystroke-ms", type=float, default=300)
    ap.add_argument("--idle-infills", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help="alternating baseline/candidate pairs")
    args = ap.parse_args()
    model = model_path(args.model)
    results: dict[int, list[dict]] = {1: [], args.parallel: []}
    for r in range(args.rounds):
        for p in (1, args.parallel):
            out = serve(model, p, args)
            results[p].append(out)
            print(f"round {r} parallel {p}: " + json.dumps({k: round(v, 1) for k, v in out.items()}), flush=True)
    print("\nmedians (spread min-max):")
    for p, runs in results.items():
        line = []
        for key in runs[0]:
            vals = [run[key] for run in runs]
            line.append(f"{key} {statistics.median(vals):.1f} ({min(vals):.1f}-{max(vals):.1f})")
        print(f"parallel {p}: " + ", ".join(line))
    base, cand = results[1], results[args.parallel]
    for key in ("chat_tok_s", "mixed_tok_s"):
        ratios = [c[key] / b[key] for b, c in zip(base, cand, strict=True) if b[key]]
        if ratios:
            print(f"{key} ratio parallel {args.parallel} / 1: median {statistics.median(ratios):.2f} "
                  f"({min(ratios):.2f}-{max(ratios):.2f})")
    for p, runs in results.items():
        r = [run["infill_ttft_p95"] / run["idle_ttft_p50"] for run in runs if run["idle_ttft_p50"]]
        if r:
            print(f"parallel {p}: /infill p95 TTFT under load / idle p50: median {statistics.median(r):.2f}")
    print(f"load: {os.getloadavg()}")


if __name__ == "__main__":
    main()
