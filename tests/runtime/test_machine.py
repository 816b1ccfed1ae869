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
