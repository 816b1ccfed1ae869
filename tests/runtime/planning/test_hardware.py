"""Machine detection, size parsing, profiles and budgets."""

from __future__ import annotations

import pytest

from tandem.errors import TandemError
from tandem.runtime.planning import hardware, memprobe
from tandem.runtime.planning.hardware import (
    PROFILES,
    GiB,
    MiB,
    parse_size,
    resolve_machine,
    with_budgets,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("6GiB", 6 * GiB), ("512MB", 512 * 1000**2), ("1.5GiB", int(1.5 * GiB)), ("4096", 4096),
     ("2 gib", 2 * GiB), ("100MiB", 100 * MiB), ("1G", 1000**3)],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "six", "6XB", "-1GiB", "0"])
def test_parse_size_rejects_bad_input(bad: str) -> None:
    with pytest.raises(TandemError, match="size"):
        parse_size(bad)


def test_detect_reads_this_machine() -> None:
    m = hardware.detect(measure_bandwidth=False)
    total, available = hardware._meminfo()
    assert m.cpu_cores >= 1
    assert 0 < m.ram_available <= m.ram_total <= total
    assert m.source == "detected"
    flags = hardware.cpu_features()
    assert m.cpu_features == flags


def test_bandwidth_measure_is_plausible() -> None:
    bw = memprobe.measure_ram_bandwidth(nbytes=8 * MiB, reps=2)
    assert 0.1 < bw < 2000  # GB/s: anything from a phone to an HBM server


def test_default_budget_leaves_headroom() -> None:
    m = resolve_machine(measure_bandwidth=False)
    assert m.host_budget == int(m.ram_available * hardware.HOST_HEADROOM)


def test_overrides_win() -> None:
    m = resolve_machine(budget="3GiB", vram="2GiB", measure_bandwidth=False)
    assert m.host_budget == 3 * GiB
    assert m.vram_budget == 2 * GiB
    assert m.gpu is not None  # --vram without a GPU describes a hypothetical one


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_profiles_are_consistent(name: str) -> None:
    m = resolve_machine(name)
    p = PROFILES[name]
    assert m.source == f"profile {name}"
    assert 0 < m.host_budget < p.ram_total
    if p.gpu is not None:
        assert 0 < m.vram_budget <= p.gpu.free_bytes
        if p.gpu.unified:
            assert m.vram_budget <= m.host_budget


def test_unknown_profile_is_a_clear_error() -> None:
    with pytest.raises(TandemError, match="Unknown machine profile"):
        resolve_machine("cray-1")


def test_unified_memory_caps_vram_by_host_budget() -> None:
    m = with_budgets(hardware.from_profile("m2-air-16"), budget="4GiB")
    assert m.vram_budget == 4 * GiB


def test_process_rss_is_positive() -> None:
    assert memprobe.process_rss() > 10 * MiB


def test_tiny_budget_without_unit_is_explained() -> None:
    with pytest.raises(TandemError, match="write a unit"):
        resolve_machine(budget="6", measure_bandwidth=False)
