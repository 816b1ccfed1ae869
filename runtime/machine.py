"""This machine, as the caches that hold per-machine measurements identify it.

One core count and one machine identity for every layer: the backends choose their
default threads with :func:`cpu_cores`, the planner prices with it, and the
speculative decoder's measured costs are cached under :func:`machine_id`. Imports
nothing of Tandem's, so backends and planning can both use it.
"""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path


def cpu_cores() -> int:
    """Cores this process may run on (its affinity mask: a container's or ``taskset``'s
    limit, not the host's count)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine_id() -> str:
    """Host, CPU model, usable cores and platform: what a timing measured here depends on."""
    return f"{platform.node()}|{cpu_model()}|{cpu_cores()}|{platform.machine()}|{platform.system()}"
