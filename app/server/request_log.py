"""A structured request log: one JSON line per request, appended to a file in the data dir.

What it records is what an operator needs to see load and speed — route, model,
status, token counts, time to first token, speed, acceptance and tokens per target call
when speculating — and never prompt or reply text (those stay on the client's side).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.models.paths import data_dir
from tandem.runtime.generate import GenerationStats


def default_path() -> Path:
    return data_dir() / "logs" / "requests.jsonl"


@dataclass
class RequestLog:
    path: Path
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        """Append one line; a line is written whole (one ``write`` under a lock)."""
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._lock, self.path.open("a", encoding="utf-8") as f:
            f.write(line)


def record(route: str, status: int, started: float, *, model: str | None = None, stream: bool = False,
           stats: GenerationStats | None = None, now: float | None = None) -> dict[str, Any]:
    """The line for one request (``started``: ``time.monotonic()`` when it arrived)."""
    end = time.monotonic() if now is None else now
    out: dict[str, Any] = {"time": round(time.time(), 3), "route": route, "status": status, "model": model,
                           "stream": stream, "duration_ms": round((end - started) * 1000, 1)}
    if stats is not None:
        out.update(prompt_tokens=stats.prompt_tokens, completion_tokens=stats.generated_tokens,
                   ttft_ms=round(stats.ttft_s * 1000, 1), generation_ms=round(stats.total_s * 1000, 1),
                   tokens_per_s=round(stats.tokens_per_s, 2) if stats.generated_tokens > 1 else None,
                   finish_reason=stats.finish_reason, target_calls=stats.target_calls,
                   tokens_per_call=round(stats.tokens_per_call, 3), drafted_tokens=stats.drafted_tokens,
                   accepted_tokens=stats.accepted_tokens,
                   acceptance_rate=None if stats.acceptance_rate is None else round(stats.acceptance_rate, 4))
    return out


async def logged_stream(body: AsyncIterator, on_end: Callable[[], None]) -> AsyncIterator:
    """A streaming response's body that writes its log line when the stream ends (done,
    failed, the client gone or too slow), not when the handler returns. Closing this
    closes ``body`` at once (its cleanup cancels the reply's job), not at garbage collection."""
    try:
        async for chunk in body:
            yield chunk
    finally:
        try:
            if isinstance(body, AsyncGenerator):
                await body.aclose()
        finally:
            on_end()
