"""One core count and one machine identity for every layer (backends, planner, caches)."""

from __future__ import annotations

import os

import pytest

from tandem.runtime.machine import cpu_cores, machine_id


def test_cores_are_the_ones_this_process_may_use() -> None:
    assert cpu_cores() == len(os.sched_getaffinity(0))
    assert f"|{cpu_cores()}|" in machine_id() and machine_id() == machine_id()


def test_a_narrower_affinity_changes_the_count_and_the_identity() -> None:
    """A container's or taskset's limit is what threads and cached timings must follow."""
    allowed = os.sched_getaffinity(0)
    wide = machine_id()
    if len(allowed) < 2:
        pytest.skip("a one-core machine has no narrower affinity to try")
    try:
        os.sched_setaffinity(0, {min(allowed)})
        assert cpu_cores() == 1 and machine_id() != wide
    finally:
        os.sched_setaffinity(0, allowed)


def test_a_file_version_changes_when_the_file_does(tmp_path) -> None:
    from tandem.runtime.machine import file_version

    model = tmp_path / "m.gguf"
    model.write_bytes(b"x" * 10)
    first = file_version(model)
    assert file_version(tmp_path / "." / "m.gguf") == first  # one file, however it is named
    model.write_bytes(b"y" * 11)
    assert file_version(model) != first
    with pytest.raises(OSError):
        file_version(tmp_path / "missing.gguf")


def test_every_per_machine_cache_keys_on_the_same_identity(tmp_path, monkeypatch) -> None:
    """The baseline, llama.cpp's sizes and the cost cache all change their key when the
    machine's identity does (another CPU of the same name, a narrower affinity)."""
    import tandem.runtime.machine as machine
    import tandem.runtime.planning.baseline as baseline
    import tandem.runtime.planning.llama_sizes as llama_sizes
    from tandem.runtime.machine import cache_key

    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    before = (baseline.machine_key(), llama_sizes.cache_path(model).name)
    for module in (machine, baseline, llama_sizes):
        monkeypatch.setattr(module, "machine_id", lambda: "another machine", raising=False)
    after = (baseline.machine_key(), llama_sizes.cache_path(model).name)
    assert before[0] != after[0] and before[1] != after[1]
    assert cache_key("a", 1) != cache_key("a", 2) and len(cache_key("a")) == 24
