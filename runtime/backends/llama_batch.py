"""Parallel sequences of one llama.cpp context, decoded together: the server's slots.

One context holds ``n_seq`` KV sequences (:attr:`LlamaConfig.n_seq`). Each slot gets a
:class:`~tandem.runtime.backends.sequence_view.SequenceView`, a full :class:`~tandem.runtime.backends.protocol.Backend` bound to
its sequence id, so every strategy (plain, speculative with any drafter, superposed,
/infill) runs on a slot unchanged, on the slot's own thread. When several slots call
``evaluate`` at once, the :class:`SequenceBatcher` gathers their requests into one
``llama_decode`` and hands each its logits rows: the weights are read once for all of
them, which is where the throughput of parallel slots comes from.

**Who decodes, and when.** No decoder thread and no timers: the caller that finds the
context free decodes everything pending (leader/follower), so a lone slot decodes at once.
What keeps the slots in step is *who was just served*: a slot that got its logits from a
decode and is still *engaged* (inside a server job, :meth:`~tandem.runtime.backends.sequence_view.SequenceView.engaged`) comes
back within a few Python steps with its next tokens, so the next decode waits for those
slots to submit or to leave (end of the job). Without that, two slots settle into
alternating one-row decodes and batching never happens.

An *urgent* slot (an editor's /infill, whose user waits for its first token) has the
context to itself until it settles (:meth:`~tandem.runtime.backends.sequence_view.SequenceView.settle`: its first token is out): its
steps wait for nobody, and nobody else's are decoded meanwhile, so the other slots'
threads sleep instead of taking the CPU from its decode (on two cores, a chat slot's
Python work between its steps costs an /infill more than its rows in a shared batch).
After that it is a slot like the others. A stopped job's slot gives up the step it waits
for (:meth:`SequenceBatcher.interrupt`), and while the /infill that stopped it waits for
that slot, the batcher decodes only urgent steps (:meth:`SequenceBatcher.hold`).

**Lossless per slot.** What a slot computes must not depend on what the others do:

* each sequence has its own KV stream (``kv_unified`` off), so its cells sit where they
  would if it ran alone: with one unified cache, the other sequences' cells interleave,
  the attention sums round differently and logits move by ~0.4 (measured on the
  Qwen2.5-Coder 0.5B);
* requests are merged only while the merged batch stays within the backend's
  :attr:`exact_batch` rows (7 in the exact configuration), where llama.cpp computes every
  row as a one-token step computes it; a longer request (a prompt) runs in decodes of its
  own. An urgent slot's prompt goes in the chunks the backend alone would use; once an
  urgent slot has been seen (an editor uses the server), any other slot's goes in chunks
  of :data:`~tandem.runtime.backends.sequence_view.PREFILL_CHUNK` rows, so an /infill that
  arrives meanwhile waits for one chunk, not a whole chat prompt (38 rows of a chat prompt
  on the 0.5B at 2 threads: 0.22 s). From 8 rows on llama.cpp's CPU matmul computes a row of a batch alike
  whatever the batch's length, and a repacked one in groups of 4 from the first row with
  the rest one by one: chunks of at most 16 rows, at least 8, each but the last a
  multiple of 4 (:func:`~tandem.runtime.backends.protocol.chunk_bounds`), give every row
  bit for bit as the whole batch gives it, in both weight layouts.

So every slot's logits are bit-identical to the same requests run alone on a one-sequence
context: a slot's greedy output equals its solo greedy output, and its greedy speculative
output equals plain greedy output, whatever the other slots do
(``tests/runtime/backends/test_llama_batch.py`` checks both on the real models). In the
fast configuration (``exact_batch`` ``None``) merging goes up to the context's batch size
and that guarantee is, as for one sequence there, not given.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import llama_cpp
import numpy as np

from tandem.errors import TandemError
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_outputs import OutputRows, flagged, in_asked_order
from tandem.runtime.backends.protocol import Backend


class StepWithdrawn(Exception):
    """A slot's step was withdrawn before it was decoded: the job it belongs to was stopped
    (:meth:`~tandem.runtime.backends.sequence_view.SequenceView.interrupt`)."""


@dataclass
class Request:
    """Positions ``pos..pos+n`` of sequence ``seq``: token ids or embedding rows."""

    seq: int
    pos: int
    tokens: list[int] | None
    embeds: np.ndarray | None
    rows: list[int]
    """Indices into this request whose logits are wanted."""
    out: np.ndarray | None = None
    """Its logits rows, one per entry of ``rows`` (a copy of its own)."""
    error: BaseException | None = None
    done: bool = False

    @property
    def n(self) -> int:
        return len(self.tokens) if self.tokens is not None else len(self.embeds)  # type: ignore[arg-type]


@dataclass
class BatchStats:
    decodes: int = 0
    """``llama_decode`` calls."""
    rows: int = 0
    """Positions decoded, all sequences together."""
    merged: int = 0
    """Decodes that carried more than one sequence."""


class SequenceBatcher:
    """Gathers the :class:`~tandem.runtime.backends.sequence_view.SequenceView` requests of one context into shared decodes."""

    def __init__(self, base: LlamaCppBackend) -> None:
        self.base = base
        self.cap = base.exact_batch or base.n_batch
        """Most rows a merged decode may carry (see the module docstring)."""
        self.stats = BatchStats()
        self._cond = threading.Condition()
        self._pending: list[Request] = []
        self._decoding = False
        self._engaged: set[int] = set()
        self._owed: set[int] = set()
        self._urgent: set[int] = set()
        self._interrupted: set[int] = set()
        self._held = False
        self._urgent_seen = False
        self._ctx_lock = threading.Lock()
        """One llama.cpp call on the context at a time (decodes, KV edits)."""
        self._batch = llama_cpp.llama_batch_init(base.n_batch, 0, 1)
        self._outputs = OutputRows(base.context, base.n_vocab)
        self._embd_batch = None
        self.views: list[Backend] = []
        """Its sequences as backends, one each (the :class:`~tandem.runtime.backends.sequence_view.SequenceView`
        objects :func:`~tandem.runtime.backends.sequence_view.open_views` makes)."""

    # -- leader/follower ------------------------------------------------------------------
    def decode(self, req: Request) -> np.ndarray:
        """Decode ``req`` in the next shared batch it fits; its logits rows."""
        with self._cond:
            if req.seq in self._interrupted:
                raise StepWithdrawn(f"sequence {req.seq} was interrupted")
            self._pending.append(req)
            self._owed.discard(req.seq)
            # No one is woken here: a step that completes a batch is led by the thread that
            # sent it (the loop below), and a decode under way wakes every waiter when it
            # ends. Waking all on each step was 3 wake-ups per slot per decode (4 slots).
            while not req.done:
                if self._decoding or not self._ready():
                    self._cond.wait()
                    continue
                group = self._take()
                self._decoding = True
                self._cond.release()
                try:
                    self._run(group)
                finally:
                    self._cond.acquire()
                    self._decoding = False
                    self._owed.update(r.seq for r in group if r.seq in self._engaged - self._interrupted)
                    self._cond.notify_all()
        if req.error is not None:
            raise req.error
        return req.out

    def _ready(self) -> bool:
        """Something is pending and every slot served last time has come back (or left);
        while a slot is urgent, only its own requests are ready, and at once; while held
        (:meth:`hold`), only urgent ones."""
        if self._urgent:
            return any(r.seq in self._urgent for r in self._pending)
        if not self._pending or self._held:
            return False
        return self._owed <= {r.seq for r in self._pending}

    def _take(self) -> list[Request]:
        """The pending requests of the next decode (only urgent slots' while there are
        any), oldest first: any number of token requests within :attr:`cap` rows, or one
        longer (or embedding) request alone."""
        group: list[Request] = []
        rows = 0
        for r in [r for r in self._pending if not self._urgent or r.seq in self._urgent]:
            alone = r.embeds is not None or r.n > self.cap
            if alone:
                if not group:
                    group.append(r)
                    break
                continue
            if rows + r.n <= self.cap:
                group.append(r)
                rows += r.n
        for r in group:
            self._pending.remove(r)
        return group

    def _run(self, group: list[Request]) -> None:
        embeds = group[0].embeds
        if embeds is not None:
            if self._embd_batch is None:
                self._embd_batch = llama_cpp.llama_batch_init(self.base.n_batch, self.base.n_embd, 1)
            batch = self._embd_batch
            chunk = np.ascontiguousarray(embeds, dtype=np.float32)
            ctypes.memmove(batch.embd, chunk.ctypes.data, chunk.nbytes)
        else:
            batch = self._batch
        at = 0
        for r in group:
            for i in range(r.n):
                if r.tokens is not None:
                    batch.token[at + i] = r.tokens[i]
                batch.pos[at + i] = r.pos + i
                batch.n_seq_id[at + i] = 1
                batch.seq_id[at + i][0] = r.seq
                batch.logits[at + i] = False
            for i in r.rows:
                batch.logits[at + i] = True
            at += r.n
        batch.n_tokens = at
        with self._ctx_lock:
            rc = self.base.decode_batch(batch)
            self.stats.decodes += 1
            self.stats.rows += at
            self.stats.merged += len(group) > 1
            if rc == 0:
                self._hand_out(group)
            for r in group:
                if rc != 0:
                    llama_cpp.llama_memory_seq_rm(self.base.memory_handle, r.seq, r.pos, -1)
                    r.error = TandemError(f"llama.cpp failed to evaluate a batch (llama_decode returned {rc}).")
                r.done = True

    def _hand_out(self, group: list[Request]) -> None:
        """Each request's logits rows, one copy each out of the decode's output block (each
        row was once viewed and copied on its own, then copied again by the slot)."""
        positions = [flagged(r.rows) for r in group]
        block = self._outputs.block(sum(len(p) for p in positions))
        at = 0
        for r, mine in zip(group, positions, strict=True):
            r.out = in_asked_order(block[at:at + len(mine)], mine, r.rows, copy=True)
            at += len(mine)

    # -- engagement: which slots the next decode waits for ----------------------------------
    def engage(self, seq: int, urgent: bool = False) -> None:
        with self._cond:
            self._engaged.add(seq)
            self._interrupted.discard(seq)
            if urgent:
                self._urgent.add(seq)
                self._urgent_seen = True

    def chunks_prompts(self, seq: int) -> bool:
        """Whether ``seq``'s long requests go in short chunks: once an urgent slot has been
        seen (an editor uses this context), for every slot but an urgent one. Until then a
        prompt goes whole: short chunks prefill about a fifth slower on 2 CPU threads."""
        with self._cond:
            return self._urgent_seen and seq not in self._urgent

    def settle(self, seq: int) -> None:
        """``seq`` is urgent no more (its first token is out): the others decode again."""
        with self._cond:
            if seq in self._urgent:
                self._urgent.discard(seq)
                self._cond.notify_all()

    def hold(self, on: bool) -> None:
        """An urgent job is about to start on a slot that frees without a decode (its
        stopped job's step was withdrawn): until ``hold(False)``, decode only urgent
        requests, so the /infill does not find a chat decode just begun."""
        with self._cond:
            self._held = on
            self._cond.notify_all()

    def interrupt(self, seq: int) -> None:
        """``seq``'s job was stopped while engaged: its pending step, and any it asks for
        until the job ends, fail with :class:`StepWithdrawn` instead of waiting for a
        decode, so the job ends now and frees its slot."""
        with self._cond:
            if seq not in self._engaged:
                return
            self._interrupted.add(seq)
            for r in [r for r in self._pending if r.seq == seq]:
                self._pending.remove(r)
                r.error, r.done = StepWithdrawn(f"sequence {seq} was interrupted"), True
            self._owed.discard(seq)
            self._urgent.discard(seq)
            self._cond.notify_all()

    def release(self, seq: int) -> None:
        """``seq`` will not come back soon (its job ended): decodes stop waiting for it."""
        with self._cond:
            self._engaged.discard(seq)
            self._interrupted.discard(seq)
            self._owed.discard(seq)
            self._urgent.discard(seq)
            self._cond.notify_all()

    # -- KV edits (between decodes) ---------------------------------------------------------
    def seq_rm(self, seq: int, start: int, end: int = -1) -> bool:
        with self._ctx_lock:
            return bool(llama_cpp.llama_memory_seq_rm(self.base.memory_handle, seq, start, end))

    def seq_move(self, seq: int, spans: Sequence[tuple[int, int]]) -> bool:
        """Pack ``spans`` of ``seq`` down in order (:meth:`Backend.keep_spans`)."""
        mem = self.base.memory_handle
        with self._ctx_lock:
            if not llama_cpp.llama_memory_can_shift(mem):
                return False
            to = 0
            for start, end in spans:
                if to < start:
                    llama_cpp.llama_memory_seq_rm(mem, seq, to, start)
                    llama_cpp.llama_memory_seq_add(mem, seq, start, end, to - start)
                to += end - start
            llama_cpp.llama_memory_seq_rm(mem, seq, to, -1)
            return True

    def close(self) -> None:
        for name in ("_batch", "_embd_batch"):
            batch = getattr(self, name)
            if batch is not None:
                llama_cpp.llama_batch_free(batch)
                setattr(self, name, None)
