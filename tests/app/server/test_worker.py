"""The model worker's scheduling (``app/server/worker.py``): /infill ahead of chat, a
superseded /infill cancelled, several lanes at once, a client sent back to its own KV,
and a lane kept free for the editor. Jobs here are plain generators; the lanes are labels."""

from __future__ import annotations

import asyncio
import threading

from tandem.app.server.worker import END, INFILL, ModelWorker

WAIT = 30


def gate_job(log: list, name: str, started: threading.Event | None = None, gate: threading.Event | None = None):
    def fn(cancel: threading.Event, lane):
        log.append((name, lane))
        if started is not None:
            started.set()
        if gate is not None:
            while not gate.wait(0.01):
                if cancel.is_set():
                    return
        yield name

    return fn


async def until(condition, timeout: float = WAIT) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


async def drain(job) -> list:
    return [item async for item in job.items()]


def test_infill_is_scheduled_ahead_of_queued_chat() -> None:
    async def main():
        worker = ModelWorker("m", lanes=["lane0"])
        log: list = []
        started, gate = threading.Event(), threading.Event()
        try:
            busy = worker.submit(gate_job(log, "busy", started, gate))
            assert await asyncio.to_thread(started.wait, WAIT)
            chats = [worker.submit(gate_job(log, f"chat{i}"), client=f"c{i}") for i in range(2)]
            infill = worker.submit(gate_job(log, "infill"), kind=INFILL, client="editor")
            assert worker.waiting == 3
            gate.set()
            await asyncio.gather(drain(busy), drain(infill), *(drain(c) for c in chats))
            assert [name for name, _ in log] == ["busy", "infill", "chat0", "chat1"]
        finally:
            worker.close()

    asyncio.run(main())


def test_a_newer_infill_from_the_same_client_cancels_the_older_ones() -> None:
    async def main():
        worker = ModelWorker("m", lanes=["lane0", "lane1"])
        log: list = []
        s1, g1 = threading.Event(), threading.Event()
        try:
            running = worker.submit(gate_job(log, "old-running", s1, g1), kind=INFILL, client="vim")
            assert await asyncio.to_thread(s1.wait, WAIT)
            blocker_started, blocker_gate = threading.Event(), threading.Event()
            blocker = worker.submit(gate_job(log, "emacs", blocker_started, blocker_gate), kind=INFILL, client="emacs")
            assert await asyncio.to_thread(blocker_started.wait, WAIT)
            # both lanes busy: the next two wait in the queue
            queued = worker.submit(gate_job(log, "old-queued"), kind=INFILL, client="vim")
            other = worker.submit(gate_job(log, "other-editor"), kind=INFILL, client="vscode")
            newest = worker.submit(gate_job(log, "newest"), kind=INFILL, client="vim")
            assert running.superseded and running.cancel.is_set()
            assert queued.superseded and queued.cancel.is_set()
            assert not other.cancel.is_set() and not newest.cancel.is_set()
            assert await drain(running) == []  # stopped at its next step, nothing more
            assert await drain(queued) == []  # never started
            blocker_gate.set()
            assert await drain(other) == ["other-editor"]
            assert await drain(newest) == ["newest"]
            await drain(blocker)
            names = [n for n, _ in log]
            assert "old-queued" not in names and names.count("newest") == 1
            assert worker.stats.superseded == 2 and worker.stats.completed == 3 and worker.stats.skipped == 0
        finally:
            worker.close()

    asyncio.run(main())


def test_a_newer_infill_waits_for_the_lane_its_superseded_one_frees() -> None:
    """The superseded /infill stops at its next step and leaves its client's text in that
    lane's cache: the newer one waits for it there (one step) rather than taking a free
    lane and evaluating the whole file again. Meanwhile the lanes' decodes are held (the
    lane frees without one), and let go once the newer one has started."""
    owners: dict[str, str | None] = {"lane0": None, "lane1": None}
    holds: list[bool] = []

    async def main():
        worker = ModelWorker("m", lanes=["lane0", "lane1"], owner=owners.get, hold=holds.append)
        log: list = []
        started, gate = threading.Event(), threading.Event()
        try:
            old = worker.submit(gate_job(log, "old", started, gate), kind=INFILL, client="vim")
            assert await asyncio.to_thread(started.wait, WAIT)
            lane = log[0][1]
            owners[lane] = "vim"  # what the old one's request leaves there when it ends
            new = worker.submit(gate_job(log, "new"), kind=INFILL, client="vim")
            assert old.superseded and worker.waiting == 1  # a lane is free, and it waits
            assert holds == [True]
            assert await drain(old) == []
            assert await drain(new) == ["new"]
            assert log[-1] == ("new", lane)
            assert holds == [True, False]
        finally:
            worker.close()

    asyncio.run(main())


def test_a_superseded_job_is_interrupted_and_its_withdrawn_step_is_no_failure() -> None:
    """Superseding a running /infill interrupts its lane (the step it waits for is
    withdrawn); the exception that ends it is the stop, not a failure to report."""
    interrupted: list[str] = []
    withdrawn = threading.Event()

    def waiting_job(log: list, started: threading.Event):
        def fn(cancel: threading.Event, lane):
            log.append(lane)
            started.set()
            assert withdrawn.wait(WAIT)
            raise RuntimeError("step withdrawn")
            yield  # a generator function

        return fn

    def interrupt(lane: str) -> None:
        interrupted.append(lane)
        withdrawn.set()

    async def main():
        worker = ModelWorker("m", lanes=["lane0"], interrupt=interrupt)
        log: list = []
        started = threading.Event()
        try:
            old = worker.submit(waiting_job(log, started), kind=INFILL, client="vim")
            assert await asyncio.to_thread(started.wait, WAIT)
            new = worker.submit(gate_job(log, "new"), kind=INFILL, client="vim")
            assert await drain(old) == []  # ended, no error raised to its client
            assert await drain(new) == ["new"]
            assert interrupted == ["lane0"]
            assert worker.stats.superseded == 1 and worker.stats.failed == 0 and worker.stats.completed == 1
        finally:
            worker.close()

    asyncio.run(main())


def test_lanes_run_jobs_at_once_and_a_client_returns_to_its_own_lane() -> None:
    owners = {"lane0": None, "lane1": "alice"}

    async def main():
        worker = ModelWorker("m", lanes=["lane0", "lane1"], owner=owners.get)
        log: list = []
        a_started, b_started, gate = threading.Event(), threading.Event(), threading.Event()
        try:
            a = worker.submit(gate_job(log, "bob", a_started, gate), client="bob")
            b = worker.submit(gate_job(log, "carol", b_started, gate), client="carol")
            # both run at once: each waits on the same gate, so neither could end first
            assert await asyncio.to_thread(a_started.wait, WAIT)
            assert await asyncio.to_thread(b_started.wait, WAIT)
            assert worker.running == 2
            gate.set()
            await asyncio.gather(drain(a), drain(b))
            await until(lambda: worker.running == 0)
            alice = worker.submit(gate_job(log, "alice"), client="alice")
            await drain(alice)
            assert log[-1] == ("alice", "lane1")
        finally:
            worker.close()

    asyncio.run(main())


def test_chat_leaves_a_lane_for_the_editor_once_one_is_seen() -> None:
    async def main():
        worker = ModelWorker("m", lanes=["lane0", "lane1"])
        log: list = []
        gate = threading.Event()
        try:
            first = worker.submit(gate_job(log, "infill"), kind=INFILL, client="vim")
            await drain(first)
            s = threading.Event()
            chat1 = worker.submit(gate_job(log, "chat1", s, gate), client="a")
            assert await asyncio.to_thread(s.wait, WAIT)
            chat2 = worker.submit(gate_job(log, "chat2", None, gate), client="b")
            assert worker.waiting == 1 and worker.running == 1  # the second lane stays free
            s2 = threading.Event()
            infill = worker.submit(gate_job(log, "infill2", s2, None), kind=INFILL, client="vim")
            assert await drain(infill) == ["infill2"]  # served at once beside chat1
            gate.set()
            await asyncio.gather(drain(chat1), drain(chat2))
        finally:
            worker.close()

    asyncio.run(main())


def test_stop_all_skips_queued_jobs() -> None:
    async def main():
        worker = ModelWorker("m")
        log: list = []
        started, gate = threading.Event(), threading.Event()
        try:
            busy = worker.submit(gate_job(log, "busy", started, gate))
            assert await asyncio.to_thread(started.wait, WAIT)
            queued = worker.submit(gate_job(log, "queued"))
            worker.stop_all()
            assert busy.cancel.is_set()
            items = [item async for item in queued.items()]
            assert items == [] and END is not None
            await drain(busy)
            assert [n for n, _ in log] == ["busy"]
        finally:
            worker.close()

    asyncio.run(main())


def test_of_its_own_lanes_a_client_gets_the_one_holding_the_longest_start_of_its_request() -> None:
    """A chat's next turn (or an agent's next step) goes where its previous turn is cached:
    the lane whose last request's text shares the longest start with this one's; with no
    such text, the client's most recent lane. Seen before: with 4 slots a chat's turns
    went round the lanes, each turn re-reading the whole conversation."""
    owners: dict[str, str | None] = {"lane0": None, "lane1": None, "lane2": None, "lane3": None}

    async def main():
        worker = ModelWorker("m", lanes=list(owners), owner=owners.get)
        log: list = []
        gate = threading.Event()
        try:
            # Three conversations at once take three lanes, which then hold alice's text.
            hints = ['[null, [{"u": "one"}', '[null, [{"u": "two"}', '[null, [{"u": "three"}']
            first = [worker.submit(gate_job(log, h, gate=gate), client="alice", hint=h) for h in hints]
            await until(lambda: worker.running == 3)
            gate.set()
            for job in first:
                await drain(job)
            await until(lambda: worker.running == 0)
            lanes = {name: lane for name, lane in log}
            owners.update({lane: "alice" for lane in lanes.values()})
            follow_up = '[null, [{"u": "two"}, {"a": "2"}, {"u": "more"}]]'
            await drain(worker.submit(gate_job(log, "two, again"), client="alice", hint=follow_up))
            assert log[-1] == ("two, again", lanes[hints[1]])
            await until(lambda: worker.running == 0)
            await drain(worker.submit(gate_job(log, "no hint"), client="alice"))
            assert log[-1] == ("no hint", lanes[hints[1]])  # the most recent of its own
            await until(lambda: worker.running == 0)
            await drain(worker.submit(gate_job(log, "bob"), client="bob", hint=follow_up))
            assert log[-1][1] != lanes[hints[1]]  # another client's text draws nobody
        finally:
            worker.close()

    asyncio.run(main())


def test_a_request_continuing_one_still_running_waits_for_its_lane() -> None:
    """A chat client has its reply (the stream's last event) a moment before the lane
    that made it is free; its next turn, sent at once, waits for that lane instead of
    taking a free one without its text. A request that does not continue it starts at once."""
    owners: dict[str, str | None] = {"lane0": None, "lane1": None}

    async def main():
        worker = ModelWorker("m", lanes=list(owners), owner=owners.get)
        log: list = []
        started, gate = threading.Event(), threading.Event()
        try:
            first = worker.submit(gate_job(log, "turn 1", started, gate), client="alice", hint='[null, [{"u": "1"}')
            assert await asyncio.to_thread(started.wait, WAIT)
            nxt = worker.submit(gate_job(log, "turn 2"), client="alice",
                                hint='[null, [{"u": "1"}, {"a": "x"}, {"u": "2"}')
            other = worker.submit(gate_job(log, "another chat"), client="alice", hint='[null, [{"u": "9"}')
            await drain(other)  # not a continuation: it took the free lane at once
            same = worker.submit(gate_job(log, "turn 1 again"), client="alice", hint='[null, [{"u": "1"}')
            await asyncio.wait_for(drain(same), WAIT)  # the same request twice at once (a load test, a proxy): no wait
            assert [name for name, _ in log] == ["turn 1", "another chat", "turn 1 again"] and worker.waiting == 1
            gate.set()
            await drain(first)
            await drain(nxt)
            assert log[-1] == ("turn 2", log[0][1])
        finally:
            worker.close()

    asyncio.run(main())
