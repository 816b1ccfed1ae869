"""A model's requests, scheduled over its slots: /infill first, the rest in arrival order.

A model serves ``len(lanes)`` requests at once (``tandem serve --parallel N``): each lane
is one KV sequence with its own thread (see :mod:`tandem.runtime.backends.llama_batch`
for how their steps share one llama.cpp batch). Waiting requests are taken

* **/infill before everything else**: an editor waits for its suggestion while the user
  types; a chat reply streams and can wait one step longer. Among requests of one kind
  the order is arrival order, so nobody is overtaken by a request of their own kind;
* **an /infill superseded by the same client's newer /infill is cancelled**, queued or
  running: llama.vim and llama.vscode send a request per keystroke, and only the newest
  one's answer is read;
* **on a lane that holds the client's own KV** when one is free (its prompt prefix is
  reused, :mod:`.cache_owner`): of several, the one whose last request shares the longest
  start with this one (``hint``: a chat's tools and messages, so an agent's or a long
  chat's next turn finds its previous turns cached), else the most recent; with none of
  its own free, on the lane used longest ago. A chat turn sent while its previous turn's
  lane is still being freed waits for that lane; so does an /infill whose client's
  superseded one still runs: the superseded one's waiting step is withdrawn
  (``interrupt``), so the lane frees at once, and until the newer one starts the lanes
  decode nothing else (``hold``);
* and, once an editor has been seen, **chat and completions leave one lane free** when the
  model has two or more, so an /infill never waits for a whole chat reply to end.

Each job streams items back to the asyncio side through an ``asyncio.Queue`` fed with
``call_soon_threadsafe``; setting the job's ``cancel`` event (the client went away, or a
newer /infill superseded it) makes a queued job be skipped and a running one stop at its
next step.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from tandem.app.server.api_error import ApiError, cancelled, shutting_down, superseded

L = TypeVar("L")

JobFn = Callable[[threading.Event, Any], Generator[Any, None, None]]
"""A job: a generator function of its cancel event and the lane it runs on, so the
worker can close it when it stops early."""

INFILL = "infill"
"""The kind of job scheduled first (and superseded by the same client's next one)."""


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
    kind: str = "chat"
    client: str = ""
    order: int = 0
    superseded: bool = False
    """Cancelled because the same client sent a newer /infill."""
    shut_down: bool = False
    """Cancelled because the server is shutting down."""
    hint: str = ""
    """The request as text that the hint of a request continuing it starts with (a chat's
    tools and messages without the closing brackets): of the client's own lanes, the one
    whose last hint shares the longest start is taken, and a request that continues one
    still running waits for its lane. Completions give none: an editor's next keystroke
    continues its previous prompt but must not wait for it."""

    def stop_error(self) -> ApiError:
        """Why this job ended before its reply did: a reply cut short is never answered as if
        it were whole (a client would take the cut text, with finish_reason "stop", for the
        answer)."""
        return superseded() if self.superseded else shutting_down() if self.shut_down else cancelled()

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
    superseded: int = 0
    """/infill jobs cancelled by the same client's newer /infill (queued or running)."""


class _LaneThread(Generic[L]):
    def __init__(self, lane: L, index: int) -> None:
        self.lane = lane
        self.index = index
        self.job: Job | None = None
        self.last_used = 0
        self.hint = ""
        """The hint of the last job started here."""
        self.wake = threading.Condition()


class ModelWorker(Generic[L]):
    """Runs jobs on ``lanes`` (one thread each). ``owner`` says which client's KV a lane
    holds (``None``: nobody's), for the affinity rule in the module docstring;
    ``interrupt`` withdraws the step a superseded job's lane is waiting to have decoded,
    so that job ends now rather than after it; ``hold(True)`` while the /infill that
    superseded it waits for that lane (the lanes decode nothing else meanwhile: the lane
    frees without a decode), ``hold(False)`` once it has started."""

    def __init__(self, name: str, max_queue: int = 64, lanes: Sequence[L] | None = None,
                 owner: Callable[[L], str | None] | None = None,
                 interrupt: Callable[[L], None] | None = None, hold: Callable[[bool], None] | None = None) -> None:
        self.name = name
        self.max_queue = max_queue
        self.stats = WorkerStats()
        self.stopping = False
        """Set by :meth:`stop_all`: stopped jobs run on to their final item."""
        self.editor_seen = False
        """An /infill has arrived: chat leaves a lane free for the editor (see module docstring)."""
        self._owner = owner or (lambda _lane: None)
        self._interrupt = interrupt or (lambda _lane: None)
        self._hold = hold or (lambda _on: None)
        self._holding = False
        self._lock = threading.Lock()
        self._queue: list[Job] = []
        self._order = itertools.count()
        self._closed = False
        self._lanes = [_LaneThread(lane, i) for i, lane in enumerate(lanes if lanes is not None else [None])]
        self._threads = [threading.Thread(target=self._run, args=(lt,), name=f"tandem-worker-{name}-{lt.index}",
                                          daemon=True) for lt in self._lanes]
        for t in self._threads:
            t.start()

    # -- what /health shows -------------------------------------------------------------
    @property
    def waiting(self) -> int:
        with self._lock:
            return len(self._queue)

    @property
    def busy(self) -> bool:
        return any(lt.job is not None for lt in self._lanes)

    @property
    def running(self) -> int:
        return sum(lt.job is not None for lt in self._lanes)

    @property
    def lanes(self) -> list[L]:
        return [lt.lane for lt in self._lanes]

    # -- scheduling ---------------------------------------------------------------------
    def submit(self, fn: JobFn, *, kind: str = "chat", client: str = "", hint: str = "") -> Job:
        """Queue ``fn``; an /infill (``kind`` :data:`INFILL`) cancels ``client``'s older ones.
        ``hint``: see :attr:`Job.hint`."""
        job = Job(fn, asyncio.get_running_loop(), asyncio.Queue(), kind=kind, client=client, hint=hint)
        with self._lock:
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"{len(self._queue)} requests are already waiting for {self.name}")
            job.order = next(self._order)
            if kind == INFILL:
                self.editor_seen = True
                self._supersede(client)
            self._queue.append(job)
            self._dispatch()
        return job

    def _supersede(self, client: str) -> None:
        def stale(job: Job | None) -> bool:
            return job is not None and job.kind == INFILL and job.client == client and not job.cancel.is_set()

        for old in [j for j in self._queue if stale(j)]:
            old.superseded = True
            old.cancel.set()
        for lt in [lt for lt in self._lanes if stale(lt.job)]:
            assert lt.job is not None
            lt.job.superseded = True
            lt.job.cancel.set()
            self._interrupt(lt.lane)

    def _next_job(self, free: int) -> Job | None:
        """The job to start now, with ``free`` lanes free: the oldest /infill that is not
        waiting for its own lane, else the oldest other job unless it would take the
        editor's lane."""
        ready = [j for j in self._queue if not self._own_lane_soon(j)]
        if not ready or free == 0:
            return None
        infills = [j for j in ready if j.kind == INFILL]
        if infills:
            return min(infills, key=lambda j: j.order)
        keep_free = 1 if (self.editor_seen and len(self._lanes) > 1) else 0
        if free <= keep_free:
            return None
        return min(ready, key=lambda j: j.order)

    def _own_lane_soon(self, job: Job) -> bool:
        """A lane still runs a job of ``job``'s client that leaves the text ``job`` wants
        in the cache and ends soon: a superseded /infill (it stops at its next step), or
        the request ``job`` continues (its hint starts with that one's and goes on: the
        previous turn of the conversation, whose reply the client already has while its
        lane is still being freed; the same request sent twice at once does not wait).
        Waiting for that lane costs a moment where another lane costs the whole prompt
        again."""
        if not job.client:
            return False
        return any(lt.job is not None and lt.job is not job and lt.job.client == job.client
                   and (lt.job.superseded or _continues(job.hint, lt.job.hint))
                   for lt in self._lanes)

    def _dispatch(self) -> None:
        """Start queued jobs on free lanes (called under ``_lock``)."""
        while True:
            free = [lt for lt in self._lanes if lt.job is None]
            job = self._next_job(len(free))
            if job is None:
                break
            self._queue.remove(job)
            own = [lt for lt in free if job.client and self._owner(lt.lane) == job.client]
            if own:
                lane = max(own, key=lambda lt: (len(os.path.commonprefix([lt.hint, job.hint])), lt.last_used))
            else:
                lane = min(free, key=lambda lt: lt.last_used)
            lane.job = job
            lane.last_used = job.order
            lane.hint = job.hint
            with lane.wake:
                lane.wake.notify()
        self._update_hold()

    def _update_hold(self) -> None:
        """Hold the lanes' decodes while a live /infill waits for its own lane (under ``_lock``)."""
        holding = any(j.kind == INFILL and not j.cancel.is_set() and self._own_lane_soon(j) for j in self._queue)
        if holding != self._holding:
            self._holding = holding
            self._hold(holding)

    def _run(self, lt: _LaneThread) -> None:
        while True:
            with lt.wake:
                while lt.job is None and not self._closed:
                    lt.wake.wait()
            job = lt.job
            if job is None:
                return
            self._run_job(job, lt.lane)
            with self._lock:
                lt.job = None
                self._dispatch()

    def _run_job(self, job: Job, lane: L) -> None:
        if job.cancel.is_set():
            if job.superseded:
                self.stats.superseded += 1
            else:
                self.stats.skipped += 1
            job.emit(END)
            return
        items = None
        try:
            items = job.fn(job.cancel, lane)
            for item in items:
                job.emit(item)
                if job.cancel.is_set() and not self.stopping:
                    break  # the client left (or a newer /infill came): nobody wants the rest
            self._count_ended(job)
        except Exception as exc:  # reported to the client as a 4xx/5xx, never kills the worker
            if job.cancel.is_set():  # a stopped job's withdrawn step: nobody waits for an error
                self._count_ended(job)
            else:
                self.stats.failed += 1
                job.emit(exc)
        finally:
            if items is not None:
                items.close()  # run the generation's cleanup (KV rollback) now, not at GC
            job.emit(END)

    def _count_ended(self, job: Job) -> None:
        if job.superseded:
            self.stats.superseded += 1
        elif job.cancel.is_set():
            self.stats.cancelled += 1
        else:
            self.stats.completed += 1

    def stop_all(self) -> None:
        """Server shutdown: stop every job. A generation sees its cancel event at the next
        step and ends (``finish_reason`` cancelled): its client gets a 503, or its stream
        an error event after the text it already has; queued jobs are skipped."""
        self.stopping = True
        with self._lock:
            for lt in self._lanes:
                if lt.job is not None:
                    lt.job.shut_down = True
                    lt.job.cancel.set()
            for job in self._queue:
                job.shut_down = True
                job.cancel.set()
            queued, self._queue = self._queue, []
            self._update_hold()
        for job in queued:
            self.stats.skipped += 1
            job.emit(END)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        for lt in self._lanes:
            with lt.wake:
                lt.wake.notify()
        for t in self._threads:
            t.join(timeout=5)


def _continues(hint: str, earlier: str) -> bool:
    """A request with ``hint`` continues one with ``earlier``: it holds all of it and more."""
    return bool(earlier) and len(hint) > len(earlier) and hint.startswith(earlier)
