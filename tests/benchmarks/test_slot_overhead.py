"""benchmarks/slot_overhead.py on the stories model: its slots decode together, and the
host's time is what the decodes leave of the wall time."""

from __future__ import annotations

from benchmarks.slot_overhead import run_slots
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_config import LlamaConfig
from tandem.runtime.backends.sequence_view import open_views


def test_slots_decode_together_and_the_decodes_are_timed_apart(stories260k) -> None:
    base = LlamaCppBackend(stories260k, LlamaConfig(n_ctx=512, n_seq=2, n_threads=1))
    batcher = open_views(base)
    try:
        alone = run_slots(batcher, 1, 24)
        both = run_slots(batcher, 2, 24)
        again = run_slots(batcher, 2, 24)  # each run starts its slots afresh
    finally:
        batcher.close()
        base.close()
    assert (alone.tokens, both.tokens, again.tokens) == (24, 48, 48)
    assert alone.decodes == 24 and both.decodes < 48  # two slots' steps shared decodes
    for run in (alone, both):
        assert 0 < run.decode_s < run.wall_s and run.host_ms_per_decode > 0
