"""Progress on stderr for CLI work that takes more than a second (loading, converting).

One line, redrawn in place on a terminal — ``tandem: loading qwen2.5-1.5b (planning
memory)… 4 s``, with a bar when the total is known — and erased when the work ends, so
the output that follows (a reply, a summary) starts on a clean line. Nothing is written
when stderr is not a terminal (logs and pipes stay clean) or the work ends within a
second.
"""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType
from typing import TextIO


def bar(done: int, total: int, width: int = 24, *, counts: bool = True) -> str:
    """``[#########---------------]  37% 9/24`` (without ``9/24`` when ``counts`` is off)."""
    denom = max(total, 1)
    filled = min(width, done * width // denom)
    tail = f" {done}/{total}" if counts else ""
    return f"[{'#' * filled}{'-' * (width - filled)}] {done * 100 // denom:3d}%{tail}"


class Progress:
    """``with Progress("loading model"): ...`` — see the module docstring.

    ``stage(text)`` names the current step; ``advance(done, total)`` shows a bar, and
    ``fraction(f)`` one for work measured in fractions (llama.cpp's model loading).
    """

    def __init__(self, label: str, stream: TextIO | None = None, *, delay: float = 1.0,
                 interval: float = 0.5, enabled: bool | None = None) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.delay, self.interval = delay, interval
        self._stage = ""
        self._done: tuple[int, int] | None = None
        self._counts = True
        self._started = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._width = 0
        self._lock = threading.Lock()

    def stage(self, text: str) -> None:
        """Name the current step; a bar shown for the step before goes (a new step has
        measured nothing yet)."""
        self._stage, self._done = text, None

    def advance(self, done: int, total: int) -> None:
        self._done, self._counts = (done, total), True

    def step(self, stage: str, done: int, total: int) -> None:
        """``stage`` and a bar at ``done`` of ``total``, in one call (work that reports both)."""
        self._stage = stage
        self.advance(done, total)

    def fraction(self, f: float) -> None:
        self._done, self._counts = (round(min(max(f, 0.0), 1.0) * 100), 100), False

    def line(self, now: float | None = None) -> str:
        elapsed = (time.monotonic() if now is None else now) - self._started
        what = f"{self.label} ({self._stage})" if self._stage else self.label
        tail = f" {bar(*self._done, counts=self._counts)}" if self._done else ""
        return f"tandem: {what}…{tail} {elapsed:.0f} s"

    def _draw(self, text: str) -> None:
        with self._lock:
            pad = max(0, self._width - len(text))
            self.stream.write("\r" + text + " " * pad)
            self.stream.flush()
            self._width = len(text)

    def _run(self) -> None:
        if self._stop.wait(self.delay):
            return
        while True:
            self._draw(self.line())
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> Progress:
        self._started = time.monotonic()
        if self.enabled:
            self._thread = threading.Thread(target=self._run, name="tandem-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            if self._width:  # erase the line: what follows starts clean
                self._draw("")
                self.stream.write("\r")
                self.stream.flush()
