"""This machine, as the caches that hold per-machine measurements identify it.

One core count and one way to key a measurement for every layer: the backends choose
their default threads with :func:`cpu_cores`, the planner prices with it, and every
cache of something measured here (the speculative decoder's costs, the process
baseline, llama.cpp's buffer sizes, the server's plans) names its entry with
:func:`cache_key` over the parts it depends on: :func:`machine_id` (the hardware),
:func:`software_id` (interpreter, kernel and packages), :func:`code_stamp` (Tandem's
own code) and :func:`file_version` (a model file). Imports nothing of Tandem's, so
backends and planning can both use it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import sys
from pathlib import Path

KEYED_PACKAGES = ("llama_cpp_python", "numpy", "tandem", "torch", "textual")
"""Packages whose version is part of :func:`software_id`."""


def cpu_cores() -> int:
    """Cores this process may run on (its affinity mask: a container's or ``taskset``'s
    limit, not the host's count)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def _cpuinfo(field: str) -> str | None:
    """The first ``field`` line of ``/proc/cpuinfo`` (``None`` where there is none)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    return None


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def memory_bytes() -> int:
    """Physical memory of this machine (0 where the OS does not say)."""
    with contextlib.suppress(ValueError, OSError, AttributeError):
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return 0


def machine_id() -> str:
    """Host, CPU model and instruction-set flags, usable cores and platform: what a
    timing or a size measured here depends on (two CPUs of one name can differ in
    flags, a VM's most of all)."""
    flags = _cpuinfo("flags") or _cpuinfo("Features") or ""
    flags_hash = hashlib.sha256(flags.encode()).hexdigest()[:12]
    return f"{platform.node()}|{cpu_model()}|{flags_hash}|{cpu_cores()}|{platform.machine()}|{platform.system()}"


@functools.cache
def software_id() -> str:
    """Interpreter, kernel, page size and the versions of :data:`KEYED_PACKAGES`: an
    upgrade of any of them changes what a process holds in memory. Read once per
    process (the packages' metadata is a scan of the install, and the modules a
    process runs are the ones it loaded, whatever is upgraded beneath it)."""
    # local: importlib.metadata costs about 20 ms, paid only here
    from importlib.metadata import PackageNotFoundError, version

    versions = []
    for name in KEYED_PACKAGES:
        try:
            versions.append(f"{name}={version(name)}")
        except PackageNotFoundError:
            versions.append(f"{name}=-")
    page = 0
    with contextlib.suppress(ValueError, OSError, AttributeError):
        page = os.sysconf("SC_PAGE_SIZE")
    return "|".join([platform.release(), sys.version, sys.executable, str(page), *versions])


def tandem_version() -> str:
    """The installed package's version ("unknown" for a source tree never installed)."""
    # local: importlib.metadata costs about 20 ms, paid only when asked
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tandem")
    except PackageNotFoundError:
        return "unknown"


def code_stamp() -> str:
    """Names, sizes and mtimes of Tandem's own modules: an edit (one that adds an
    import, or changes a rule a cached answer came from) makes it new."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for sub in ("app", "runtime", "models", "kernels"):
        for f in sorted((root / sub).rglob("*.py")):
            st = f.stat()
            h.update(f"{f.relative_to(root)}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def file_version(path: str | os.PathLike[str]) -> str:
    """One version of a file: its resolved path, size and modification time (a model
    replaced under the same name is another version). Raises ``OSError`` when missing."""
    resolved = Path(path).resolve()
    st = resolved.stat()
    return f"{resolved}|{st.st_size}|{st.st_mtime_ns}"


def cache_key(*parts: object) -> str:
    """The name of a cache entry that depends on ``parts`` (24 hex digits)."""
    return hashlib.sha256("\n".join(map(str, parts)).encode()).hexdigest()[:24]
