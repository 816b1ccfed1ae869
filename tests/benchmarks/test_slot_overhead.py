"""benchmarks/slot_overhead.py on the stories model: its slots decode together, and the
host's time is what the decodes leave of the wall time."""

from __future__ import annotations

from benchmarks.slot_overhead import run_slots
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_config import LlamaConfig
from tandem.runtime.backends.sequence_view import open_views


def test_each_run_starts_its_slots_afresh_and_times_the_decodes_apart(stories260k) -> None:
    """(Whether two slots' steps share decodes depends on the threads' timing, which on a
    model this fast may let one reply end before the other starts: the batcher's own tests
    check sharing on the real 0.5B.)"""
    base = LlamaCppBackend(stories260k, LlamaConfig(n_ctx=512, n_seq=2, n_threads=1))
    batcher = open_views(base)
    try:
        alone = run_slots(batcher, 1, 24)
        both = run_slots(batcher, 2, 24)
        again = run_slots(batcher, 2, 24)
    finally:
        batcher.close()
        base.close()
    assert (alone.tokens, both.tokens, again.tokens) == (24, 48, 48)
    assert both.replies == again.replies and alone.replies[0] == both.replies[0]  # greedy, from a clean cache
    assert alone.decodes == 24 and 24 <= both.decodes <= 48
    for run in (alone, both):
        assert 0 < run.decode_s < run.wall_s and run.host_ms_per_decode > 0


def test_speculative_slots_give_the_plain_replies(stories260k) -> None:
    base = LlamaCppBackend(stories260k, LlamaConfig(n_ctx=512, n_seq=2, n_threads=1))
    batcher = open_views(base)
    try:
        plain = run_slots(batcher, 2, 32)
        drafted = run_slots(batcher, 2, 32, speculative=True)
    finally:
        batcher.close()
        base.close()
    assert drafted.tokens == plain.tokens == 64
    assert drafted.replies == plain.replies
