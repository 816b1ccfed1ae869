"""`tandem chat` start-up as a user sees it: seconds from the command until the input box
is on screen, and until the model is loaded (the status line names it), in a real
terminal (tmux), polled every 20 ms.

Run from the repository root: ``python -m benchmarks.chat_startup --model M [--draft D]
--threads 2 --rounds 5``. Each round starts in a fresh data folder (``first``) and then
again in the same one (``again``): the first run of a model measures what later runs
reuse. Needs tmux.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

INPUT_MARK = "Message (Enter sends"


def tmux(socket: str, *args: str) -> str:
    return subprocess.run(["tmux", "-L", socket, *args], capture_output=True, text=True, check=False).stdout


def one_start(cmd: list[str], env: dict[str, str], loaded_mark: str, timeout: float = 300) -> tuple[float, float]:
    """(seconds to the input box, seconds to the loaded model) for one start."""
    socket = f"tandem-bench-{uuid.uuid4().hex[:8]}"
    shell = " ".join(f"'{c}'" for c in cmd)
    envs = [arg for k, v in env.items() for arg in ("-e", f"{k}={v}")]
    start = time.perf_counter()
    tmux(socket, "new-session", "-d", "-s", "chat", "-x", "120", "-y", "32", *envs, shell)
    seen_input = None
    try:
        while time.perf_counter() - start < timeout:
            pane = tmux(socket, "capture-pane", "-p", "-t", "chat")
            now = time.perf_counter() - start
            if seen_input is None and INPUT_MARK in pane:
                seen_input = now
            if loaded_mark in pane:
                return seen_input if seen_input is not None else now, now
            time.sleep(0.02)
        raise SystemExit(f"the chat never loaded; the pane shows:\n{pane}")
    finally:
        tmux(socket, "kill-server")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if shutil.which("tmux") is None:
        raise SystemExit("tmux is not installed")
    cmd = [str(Path(sys.executable).parent / "tandem"), "chat", "-m", args.model, "--threads", str(args.threads)]
    cmd += ["--draft", args.draft] if args.draft else []
    mark = f"Model {Path(args.model).stem}"
    results: dict[str, list[tuple[float, float]]] = {"first": [], "again": []}
    for r in range(args.rounds):
        home = tempfile.mkdtemp(prefix="tandem-chat-")
        # The kernel probe a first run may leave in the background would slow the runs after it.
        env = {"TANDEM_HOME": home, "HF_HUB_OFFLINE": "1", "TANDEM_KERNEL_PROBE": "off"}
        for kind in ("first", "again"):
            results[kind].append(one_start(cmd, env, mark))
        shutil.rmtree(home, ignore_errors=True)
        print(f"round {r + 1}: " + ", ".join(f"{k} input {v[-1][0]:.2f} s, loaded {v[-1][1]:.2f} s"
                                            for k, v in results.items()), file=sys.stderr)
    print(f"tandem chat, model {Path(args.model).name}, drafter {Path(args.draft).name if args.draft else '-'}, "
          f"{args.threads} threads, {args.rounds} rounds; load: {os.getloadavg()[0]:.2f}")
    for kind, xs in results.items():
        shown, loaded = [x[0] for x in xs], [x[1] for x in xs]
        print(f"  {kind:6s} input shown {statistics.median(shown):.2f} s ({min(shown):.2f}-{max(shown):.2f}), "
              f"model loaded {statistics.median(loaded):.2f} s ({min(loaded):.2f}-{max(loaded):.2f})")


if __name__ == "__main__":
    main()
