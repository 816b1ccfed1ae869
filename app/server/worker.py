"""One generation at a time per model, in arrival order, and cancellable.

A model has one KV cache, so its requests run one after another on a single worker
thread; a FIFO queue makes that fair (nobody is overtaken). Each job streams items back
to the asyncio side through an ``asyncio.Queue`` fed with ``call_soon_threadsafe``;
setting the job's ``cancel`` event (the client went away) makes a queued job be skipped
and a running one stop at its next step.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

JobFn = Callable[[threading.Event], Generator[Any, None, None]]
"""A job: a generator function, so the worker can close it when it stops early."""


class _End:
    """Marks the end of a job's stream."""


END = _End()


class QueueFull(Exception):
    """Too many requests already waiting for this model."""


@dataclass
class Job:
    fn: JobFn
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    cancel: threading.Event = field(default_factory=threading.Event)

    def emit(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancel.set()

    async def items(self) -> Any:
        """Async iterator over what the job produces; re-raises an exception it raised."""
        while True:
            item = await self.out.get()
            if item is END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


@dataclass
class WorkerStats:
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    skipped: int = 0
    """Jobs whose client left while they were still queued."""


class ModelWorker:
    def __init__(self, name: str, max_queue: int = 64) -> None:
        self.name = name
        self.max_queue = max_queue
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self.stats = WorkerStats()
        self.busy = False
        self.stopping = False
        """Set by :meth:`stop_all`: stopped jobs run on to their final item."""
        self._current: Job | None = None
        self._thread = threading.Thread(target=self._run, name=f"tandem-worker-{name}", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    def submit(self, fn: JobFn) -> Job:
        if self._queue.qsize() >= self.max_queue:
            raise QueueFull(f"{self._queue.qsize()} requests are already waiting for {self.name}")
        job = Job(fn, asyncio.get_running_loop(), asyncio.Queue())
        self._queue.put(job)
        return job

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if job.cancel.is_set():
                self.stats.skipped += 1
                job.emit(END)
                continue
            self.busy = True
            self._current = job
            items = None
            try:
                items = job.fn(job.cancel)
                for item in items:
                    job.emit(item)
                    if job.cancel.is_set() and not self.stopping:
                        break  # the client left: nobody wants the rest
                if job.cancel.is_set():
                    self.stats.cancelled += 1
                else:
                    self.stats.completed += 1
            except Exception as exc:  # reported to the client as a 4xx/5xx, never kills the worker
                self.stats.failed += 1
                job.emit(exc)
            finally:
                if items is not None:
                    items.close()  # run the generation's cleanup (KV rollback) now, not at GC
                self.busy = False
                self._current = None
                job.emit(END)

    def stop_all(self) -> None:
        """Server shutdown: stop every job. A generation sees its cancel event at the next
        step and ends with its final event (``finish_reason`` cancelled), so the client
        still gets a whole reply with what was generated; queued jobs are skipped."""
        self.stopping = True
        current = self._current
        if current is not None:
            current.cancel.set()
        for job in list(self._queue.queue):
            if job is not None:
                job.cancel.set()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
