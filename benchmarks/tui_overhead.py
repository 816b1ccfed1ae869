"""What the chat UI costs generation: one reply via ``run_reply`` alone vs inside the headless app.

``python -m benchmarks.tui_overhead MODEL.gguf [--tokens N] [--repeats R]``: both paths use the
same engine code, alternate R times in one process (the machine may be busy), and the
medians of the stored stats (decode tok/s, TTFT) are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path

from tandem.app.history.database import History
from tandem.app.tui.app import AppConfig, TandemApp
from tandem.app.tui.model_choice import ModelChoice, load_engine
from tandem.app.tui.session import ChatSettings, run_reply
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.engine.spec import EngineSpec

PROMPT = "Once upon a time"


def _history() -> History:
    return History(Path(tempfile.mkdtemp()) / "bench.sqlite3")


def plain(engine, settings: ChatSettings) -> dict:
    with _history() as h:
        chat = h.create_chat(params=settings.to_dict())
        h.add_message(chat.id, "user", PROMPT)
        return run_reply(engine, h, h.get_chat(chat.id)).stats or {}


async def in_app(model: Path, settings: ChatSettings, threads: int) -> dict:
    app = TandemApp(AppConfig(model=model, settings=settings, threads=threads,
                              history_path=Path(tempfile.mkdtemp()) / "bench.sqlite3"))
    async with app.run_test(size=(100, 30)) as pilot:
        await app.workers.wait_for_complete()
        await pilot.pause()
        screen = app.screen
        screen.input.load_text(PROMPT)
        await pilot.press("enter")
        while screen.replies_done < 1:
            await pilot.pause(0.02)
        return app.history.messages(screen.chat.id)[-1].stats or {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    settings = ChatSettings(SamplingParams(temperature=0.0), args.tokens)
    engine = load_engine(ModelChoice(EngineSpec(args.model, threads=args.threads)))
    rows: dict[str, list[dict]] = {"run_reply alone": [], "in the TUI": []}
    for _ in range(args.repeats):
        rows["run_reply alone"].append(plain(engine, settings))
        rows["in the TUI"].append(asyncio.run(in_app(args.model, settings, args.threads)))
    for name, stats in rows.items():
        tps = statistics.median(s["tokens_per_s"] for s in stats)
        ttft = statistics.median(s["ttft_s"] for s in stats) * 1000
        print(f"{name:16s} decode {tps:7.0f} tok/s   TTFT {ttft:6.1f} ms   (median of {len(stats)})")


if __name__ == "__main__":
    main()
