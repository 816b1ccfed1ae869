"""Parallel sequences in one llama.cpp context (``runtime/backends/llama_batch.py``), on
the real models: each slot's output is its solo output, speculative equals plain per
slot, and the slots' steps really share ``llama_decode`` calls."""

from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np
import pytest

from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_batch import StepWithdrawn
from tandem.runtime.backends.llama_config import LlamaConfig
from tandem.runtime.backends.protocol import chunk_bounds
from tandem.runtime.backends.sequence_view import (
    CHUNK_ALIGN,
    CHUNK_MIN,
    PREFILL_CHUNK,
    SequenceView,
    open_views,
)
from tandem.runtime.generate import DoneEvent, generate
from tandem.runtime.speculative.factory import SpecOptions, build_strategy

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The three primary colours are",
    "import json\n\ndef load(path):\n    with open(path) as f:\n        return json.load(f)\n\ndef save(path, data):\n",
    "Write a haiku about the sea:\n",
]
N_TOKENS = 40
CONFIG = LlamaConfig(n_ctx=512, n_threads=1)


def _greedy(target, prompt: str, speculative: bool) -> list[int]:
    ids = target.tokenize(prompt, add_bos=True)
    strategy = build_strategy(target, None, SpecOptions(mode="ngram", measure_cost=False, suffix_memory="request")) \
        if speculative else None
    kwargs = {"strategy": strategy} if strategy is not None else {}
    done = None
    for ev in generate(target, ids, Sampler(SamplingParams(temperature=0.0)), max_tokens=N_TOKENS,
                       stop_at_eog=False, **kwargs):
        if isinstance(ev, DoneEvent):
            done = ev
    if strategy is not None:
        strategy.close()
    assert done is not None
    return list(done.tokens)


def _in_parallel(views: list[SequenceView], jobs) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in jobs]
    errors: list[BaseException] = []
    start = threading.Barrier(len(jobs))

    def run(i: int) -> None:
        try:
            with views[i].engaged():
                start.wait()
                out[i] = jobs[i](views[i])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return out


def _until_queued(batcher, seq: int, what: str) -> None:
    """Wait (up to two minutes) until ``seq`` has a step pending in ``batcher``: its thread
    may start late on a loaded box."""
    idle = threading.Event()
    for _ in range(1200):
        with batcher._cond:
            if any(r.seq == seq for r in batcher._pending):
                return
        idle.wait(0.1)
    pytest.fail(f"{what} was never queued")


@pytest.fixture(scope="module")
def qwen05(real_models):
    return real_models.qwen_05b


@pytest.fixture(scope="module")
def solo(qwen05):
    """Every prompt alone on a one-sequence context: plain greedy tokens."""
    with LlamaCppBackend(qwen05, CONFIG) as backend:
        return [_greedy(backend, p, speculative=False) for p in PROMPTS]


def test_each_slot_equals_its_solo_run_and_decodes_are_shared(qwen05, solo):
    base = LlamaCppBackend(qwen05, replace(CONFIG, n_seq=4))
    batcher = open_views(base)
    try:
        assert [v.n_ctx for v in batcher.views] == [512] * 4
        outs = _in_parallel(batcher.views, [lambda v, p=p: _greedy(v, p, speculative=False) for p in PROMPTS])
        assert outs == solo
        # batching happened: fewer decodes than positions, most of them shared
        stats = batcher.stats
        steps = 4 * N_TOKENS
        assert stats.merged > N_TOKENS // 2, vars(stats)
        assert stats.decodes < steps * 0.75, vars(stats)
    finally:
        batcher.close()
        base.close()


def test_speculative_slot_equals_plain_slot_under_batching(qwen05, solo):
    """Slots 0-1 decode with model-free speculation while slots 2-3 decode plainly, all at
    once: a speculative slot's greedy output is the plain (solo) greedy output."""
    base = LlamaCppBackend(qwen05, replace(CONFIG, n_seq=4))
    batcher = open_views(base)
    try:
        jobs = [lambda v, p=PROMPTS[2]: _greedy(v, p, speculative=True),
                lambda v, p=PROMPTS[0]: _greedy(v, p, speculative=True),
                lambda v, p=PROMPTS[2]: _greedy(v, p, speculative=False),
                lambda v, p=PROMPTS[3]: _greedy(v, p, speculative=False)]
        outs = _in_parallel(batcher.views, jobs)
        assert outs == [solo[2], solo[0], solo[2], solo[3]]
        assert batcher.stats.merged > 0
    finally:
        batcher.close()
        base.close()


LONG_PROMPT = ("import json\nfrom pathlib import Path\n\n\ndef load_settings(path: Path) -> dict:\n"
               "    \"\"\"Read the settings file, or the defaults when there is none.\"\"\"\n"
               "    if not path.exists():\n        return {\"theme\": \"dark\", \"font_size\": 12}\n"
               "    with path.open() as f:\n        return json.load(f)\n")


@pytest.mark.parametrize("repack", [False, True], ids=["as-stored", "repacked"])
def test_a_slots_prompt_in_chunks_gives_every_row_of_one_batch(qwen05, repack: bool):
    """Once an editor uses the context, a slot that is not urgent sends a long prompt in
    chunks of ``PREFILL_CHUNK`` rows (an /infill arriving meanwhile waits for one chunk;
    before, it goes whole); every row's logits, and the step after
    the prompt, are bit for bit those of the whole prompt in one batch on a one-sequence
    context, whatever the prompt's length, in both weight layouts: so a slot's output stays
    its solo output."""
    config = replace(CONFIG, repack=repack)
    with LlamaCppBackend(qwen05, config) as alone:
        ids = alone.tokenize(LONG_PROMPT, add_bos=True)
        lengths = [n for n in (PREFILL_CHUNK + 1, PREFILL_CHUNK + 6, 2 * PREFILL_CHUNK + 5, 2 * PREFILL_CHUNK + 11,
                               len(ids)) if n <= len(ids)]
        assert len(lengths) == 5 and lengths[-1] > 3 * PREFILL_CHUNK
        # 17 = 8 + 9, 22 = 12 + 10, 37 = 16 + 12 + 9, 43 = 16 + 16 + 11: a short tail borrows whole groups of 4
        assert [[b - a for a, b in chunk_bounds(n, PREFILL_CHUNK, CHUNK_MIN, CHUNK_ALIGN)] for n in lengths[:4]] == \
            [[8, 9], [12, 10], [16, 12, 9], [16, 16, 11]]
        whole = {}
        for n in lengths:
            alone.truncate(0)
            rows = alone.evaluate(ids[:n], logits_for=list(range(n)))
            whole[n] = (rows, alone.evaluate([ids[0]]))
    base = LlamaCppBackend(qwen05, replace(config, n_seq=2))
    batcher = open_views(base)
    try:
        view = batcher.views[1]
        decodes = batcher.stats.decodes
        assert np.array_equal(view.evaluate(ids[:lengths[-1]], logits_for=list(range(lengths[-1]))),
                              whole[lengths[-1]][0])
        assert batcher.stats.decodes - decodes == 1  # no editor seen yet: a prompt goes whole
        with batcher.views[0].engaged(urgent=True):  # an editor's request: from now on, chunks
            pass
        for n in lengths:
            view.truncate(0)
            decodes = batcher.stats.decodes
            rows = view.evaluate(ids[:n], logits_for=list(range(n)))
            assert batcher.stats.decodes - decodes == len(chunk_bounds(n, PREFILL_CHUNK, CHUNK_MIN, CHUNK_ALIGN))
            assert np.array_equal(rows, whole[n][0]), f"{n} rows: max diff {np.abs(rows - whole[n][0]).max()}"
            assert np.array_equal(view.evaluate([ids[0]]), whole[n][1])
    finally:
        batcher.close()
        base.close()


def test_views_keep_their_own_cache(qwen05):
    """Truncating or moving one sequence leaves the others' KV alone."""
    base = LlamaCppBackend(qwen05, replace(CONFIG, n_seq=2))
    batcher = open_views(base)
    try:
        a, b = batcher.views
        ids = a.tokenize(PROMPTS[0], add_bos=True)
        la = a.evaluate(ids)
        lb = b.evaluate(ids)
        assert (la == lb).all()
        a.truncate(3)
        assert len(a.tokens) == 3 and b.tokens == ids
        again = b.evaluate([ids[-1]])
        a.evaluate(ids[3:])
        assert (a.evaluate([ids[-1]]) == again).all()
        assert a.keep_spans([(0, 2), (5, len(ids))]) and len(a.tokens) == len(ids) - 3
        assert b.tokens == ids + [ids[-1]]
    finally:
        batcher.close()
        base.close()


def test_an_urgent_slot_does_not_wait_for_slots_still_thinking(real_models):
    """Slot 0 was served and has not come back (its job still runs): a plain slot's step
    would wait for it, an urgent one (/infill) is decoded at once."""
    base = LlamaCppBackend(real_models.smollm2, replace(CONFIG, n_seq=2))
    batcher = open_views(base)
    a, b = batcher.views
    hold, served = threading.Event(), threading.Event()
    ids = a.tokenize(PROMPTS[1], add_bos=True)

    def thinking_slot() -> None:
        with a.engaged():
            a.evaluate(ids)
            served.set()
            hold.wait(120)

    thread = threading.Thread(target=thinking_slot)
    thread.start()
    try:
        assert served.wait(120)
        done = threading.Event()

        def urgent() -> None:
            with b.engaged(urgent=True):
                b.evaluate(ids)
            done.set()

        worker = threading.Thread(target=urgent)
        worker.start()
        assert done.wait(120), "the urgent slot waited for the thinking one"
        worker.join()
    finally:
        hold.set()
        thread.join()
        batcher.close()
        base.close()


def test_an_urgent_slot_has_the_context_to_itself_until_it_settles(real_models):
    """While an /infill waits for its first token, a chat slot's step is not decoded at
    all (neither alone nor merged into the urgent step); once the urgent slot settles,
    the two share the next decode."""
    base = LlamaCppBackend(real_models.smollm2, replace(CONFIG, n_seq=2))
    batcher = open_views(base)
    chat, editor = batcher.views
    token = chat.tokenize(PROMPTS[1], add_bos=True)[:1]
    chat_done = threading.Event()

    def chat_step() -> None:
        with chat.engaged():
            chat.evaluate(token)
            chat_done.set()

    thread = None
    try:
        with editor.engaged(urgent=True):
            thread = threading.Thread(target=chat_step)
            thread.start()
            _until_queued(batcher, chat.seq, "the chat slot's step")
            assert not chat_done.is_set()
            editor.evaluate(token)  # the urgent step is decoded alone
            assert not chat_done.is_set() and batcher.stats.merged == 0
            editor.settle()
            editor.evaluate(token)  # its next step: now shared with the chat slot's
            assert chat_done.wait(120), "the chat slot's step stayed queued after the urgent slot settled"
            assert batcher.stats.merged == 1
    finally:
        if thread is not None:
            thread.join(120)
        batcher.close()
        base.close()


def test_an_interrupted_slot_gives_up_its_waiting_step_at_once(real_models):
    """A superseded /infill's slot waits for its step behind a chat slot that has not come
    back: interrupted, the step is withdrawn (nothing decoded, the slot's cache unchanged)
    and every later step of that job fails at once; its next job runs normally."""
    base = LlamaCppBackend(real_models.smollm2, replace(CONFIG, n_seq=2))
    batcher = open_views(base)
    chat, editor = batcher.views
    ids = chat.tokenize(PROMPTS[1], add_bos=True)
    hold, served = threading.Event(), threading.Event()
    outcome: list[BaseException | None] = []

    def thinking_chat() -> None:
        with chat.engaged():
            chat.evaluate(ids)
            served.set()
            hold.wait(120)

    def stale_editor() -> None:
        with editor.engaged():
            try:
                editor.evaluate(ids)
                outcome.append(None)
            except StepWithdrawn as exc:
                outcome.append(exc)
            try:
                editor.evaluate(ids[:1])
            except StepWithdrawn as exc:
                outcome.append(exc)

    threads = [threading.Thread(target=thinking_chat)]
    threads[0].start()
    try:
        assert served.wait(120)
        threads.append(threading.Thread(target=stale_editor))
        threads[1].start()
        _until_queued(batcher, editor.seq, "the editor's step")  # it waits for the chat slot
        decodes = batcher.stats.decodes
        editor.interrupt()
        threads[1].join(120)
        assert not threads[1].is_alive(), "the interrupted step kept waiting"
        assert len(outcome) == 2 and all(isinstance(e, StepWithdrawn) for e in outcome)
        assert batcher.stats.decodes == decodes and editor.tokens == []
        with editor.engaged(urgent=True):  # a new job on the slot: served as ever
            assert editor.evaluate(ids).shape == (1, editor.n_vocab) and editor.tokens == ids
    finally:
        hold.set()
        for t in threads:
            t.join(120)
        batcher.close()
        base.close()


def test_a_held_batcher_decodes_only_urgent_steps(real_models):
    """Held (an /infill is about to start on a slot being freed), a chat slot's step waits
    while an urgent one is decoded; let go, the chat step is decoded."""
    base = LlamaCppBackend(real_models.smollm2, replace(CONFIG, n_seq=2))
    batcher = open_views(base)
    chat, editor = batcher.views
    ids = chat.tokenize(PROMPTS[1], add_bos=True)
    chat_done = threading.Event()

    def chat_step() -> None:
        with chat.engaged():
            chat.evaluate(ids)
            chat_done.set()

    batcher.hold(True)
    thread = threading.Thread(target=chat_step)
    thread.start()
    try:
        _until_queued(batcher, chat.seq, "the chat slot's step")
        with editor.engaged(urgent=True):
            editor.evaluate(ids)  # decoded while held
        assert not chat_done.is_set() and batcher.stats.decodes == 1
        batcher.hold(False)
        assert chat_done.wait(120), "the chat step stayed queued after the hold"
    finally:
        batcher.hold(False)
        thread.join(120)
        batcher.close()
        base.close()


def test_a_slots_logits_rows_come_in_the_order_asked_and_merged_steps_keep_them_apart(real_models):
    """Rows asked out of order or twice come back as asked, and two slots' steps merged
    into one decode each get their own rows: every row as the one-sequence context gives it."""
    with LlamaCppBackend(real_models.smollm2, CONFIG) as alone:
        ids = alone.tokenize(PROMPTS[0], add_bos=True)
        other = alone.tokenize(PROMPTS[3], add_bos=True)
        every = alone.evaluate(ids, logits_for=range(len(ids)))
        alone.truncate(0)
        want = alone.evaluate(ids, logits_for=[2, 0, 2, len(ids) - 1])
        assert np.array_equal(want, every[[2, 0, 2, len(ids) - 1]])  # one context alone, asked out of order
        alone.truncate(0)
        want_other = alone.evaluate(other, logits_for=range(len(other)))
    base = LlamaCppBackend(real_models.smollm2, replace(CONFIG, n_seq=2))
    batcher = open_views(base)
    a, b = batcher.views
    try:
        got = a.evaluate(ids, logits_for=[2, 0, 2, len(ids) - 1])
        assert got.shape == want.shape and np.array_equal(got, want)
        a.truncate(0)
        outs = _in_parallel(batcher.views, [lambda v: v.evaluate(ids, logits_for=[2, 0, 2, len(ids) - 1]),
                                            lambda v: v.evaluate(other, logits_for=range(len(other)))])
        assert np.array_equal(outs[0], want) and np.array_equal(outs[1], want_other)
    finally:
        batcher.close()
        base.close()
