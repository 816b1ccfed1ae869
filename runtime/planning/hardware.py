"""What machine are we planning for: detected here, or a named profile of another one.

The planner needs four things about a machine: how much host memory it may use, how
much GPU memory (if any), how many CPU cores, and how fast memory is (decode speed is
bound by reading the weights once per token). Everything detected can be overridden:
``--budget 6GiB`` caps host memory, ``--vram 4GiB`` device memory, and ``--profile``
plans for another machine entirely (numbers documented in :data:`PROFILES`).

CUDA is looked up through torch only when an NVIDIA device node exists, so planning on
a CPU-only machine never pays for importing torch.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from tandem.errors import TandemError
from tandem.runtime.backends import llama_devices
from tandem.runtime.machine import cpu_cores
from tandem.runtime.planning.baseline import machine_baseline

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
GiB = 1024**3
MiB = 1024**2

HOST_HEADROOM = 0.85
"""Share of *available* RAM a detected machine's default budget takes: the rest is left
to the OS and other programs so the page cache and the desktop do not thrash."""
VRAM_HEADROOM = 0.92
"""Share of *free* VRAM the default device budget takes (drivers fragment the rest)."""


def parse_size(text: str | int) -> int:
    """``6GiB`` / ``512MB`` / ``1.5g`` / ``4096`` (bytes) to bytes. Decimal units are powers
    of 1000 and binary ones of 1024; a bare ``G``/``M`` is taken as decimal, as disks do."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise TandemError(f"Cannot read the size {text!r}: write it like 6GiB, 512MB or 1.5GB.")
    value = float(m.group(1)) * _UNITS[unit]
    if value <= 0:
        raise TandemError(f"The size {text!r} must be positive.")
    return int(value)


def format_size(n: int | float) -> str:
    """Bytes as a short human string in binary units (``5.2 GiB``)."""
    n = float(n)
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}" if abs(n) < 100 * size else f"{n / size:.0f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class GPU:
    name: str
    total_bytes: int
    free_bytes: int
    bandwidth_gbs: float
    """Memory bandwidth in GB/s (measured when detected, published figure in a profile)."""
    index: int = 0
    kind: str = "cuda"
    """``cuda`` (a discrete NVIDIA GPU) or ``metal`` (Apple unified memory)."""
    unified: bool = False
    """True when the GPU shares host RAM (Apple silicon): one budget covers both."""


@dataclass(frozen=True)
class Machine:
    """A machine to plan for, with the budgets the planner must stay under."""

    name: str
    cpu_cores: int
    """Logical cores this process may use (threads for llama.cpp)."""
    cpu_features: frozenset[str]
    ram_total: int
    ram_available: int
    ram_bandwidth_gbs: float
    gpus: tuple[GPU, ...] = ()
    host_budget: int = 0
    """Bytes of host memory the plan may use (0: not set yet, see :func:`with_budgets`)."""
    vram_budget: int = 0
    source: str = "detected"
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def gpu(self) -> GPU | None:
        return self.gpus[0] if self.gpus else None

    def describe(self) -> str:
        feats = ",".join(sorted(f for f in self.cpu_features if f.startswith(("avx", "neon", "sve", "amx"))))
        gpu = self.gpu
        g = f"; GPU {gpu.name} {format_size(gpu.free_bytes)} free" if gpu else "; no GPU"
        return (f"{self.name}: {self.cpu_cores} cores ({feats or 'baseline'}), RAM {format_size(self.ram_total)} "
                f"({format_size(self.ram_available)} available){g}")


@dataclass(frozen=True)
class Profile:
    """A documented laptop, for planning a machine other than this one."""

    description: str
    cpu_cores: int
    cpu_features: frozenset[str]
    ram_total: int
    host_budget: int
    """What a model may take with a browser and the OS running: ~60-70 % of RAM."""
    ram_bandwidth_gbs: float
    gpu: GPU | None = None


_X86 = frozenset({"avx", "avx2", "fma", "f16c"})
PROFILES: dict[str, Profile] = {
    # Dual-channel DDR4-3200 is 51 GB/s peak; laptops sustain ~35-40 in practice.
    "8gb-laptop": Profile("8 GiB x86 laptop, 4 cores / 8 threads, DDR4, no GPU",
                          8, _X86, 8 * GiB, 5 * GiB, 38.0),
    # Dual-channel DDR5-4800 is 77 GB/s peak; ~55 sustained.
    "16gb-laptop": Profile("16 GiB x86 laptop, 8 cores / 16 threads, DDR5, no GPU",
                           16, _X86, 16 * GiB, 10 * GiB, 55.0),
    # Apple M2 (8-core CPU, 10-core GPU), LPDDR5 100 GB/s unified. macOS lets the GPU wire
    # about 2/3 of RAM; the budget leaves the OS and apps ~5 GiB.
    "m2-air-16": Profile("MacBook Air M2, 16 GiB unified memory (Metal GPU shares it)",
                         8, frozenset({"neon", "dotprod", "fp16"}), 16 * GiB, 11 * GiB, 100.0,
                         GPU("Apple M2 (10-core GPU)", int(10.7 * GiB), int(10.7 * GiB), 100.0,
                             kind="metal", unified=True)),
    # RTX 3060 Laptop GPU: 6 GiB GDDR6 on a 192-bit bus, 336 GB/s; host 16 GiB DDR4.
    "rtx3060-laptop": Profile("16 GiB x86 laptop with an RTX 3060 Laptop GPU (6 GiB GDDR6)",
                              16, _X86, 16 * GiB, 10 * GiB, 40.0,
                              GPU("NVIDIA GeForce RTX 3060 Laptop GPU", 6 * GiB, int(5.6 * GiB), 336.0)),
    # Raspberry Pi 5, 8 GiB LPDDR4X-4267 on 32 bits: ~17 GB/s peak, ~10 sustained.
    "rpi5-8gb": Profile("Raspberry Pi 5, 8 GiB, 4x Cortex-A76", 4, frozenset({"neon", "dotprod"}),
                        8 * GiB, 6 * GiB, 10.0),
}


# -- detection ------------------------------------------------------------------------
def _meminfo() -> tuple[int, int]:
    """(total, available) RAM in bytes from /proc/meminfo, or from sysconf elsewhere."""
    try:
        values: dict[str, int] = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            values[key] = int(rest.split()[0]) * 1024
        return values["MemTotal"], values.get("MemAvailable", values.get("MemFree", 0))
    except (OSError, KeyError, ValueError, IndexError):
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return pages * size, pages * size // 2


def cgroup_memory_limit() -> int | None:
    """A container's memory limit (cgroup v2 or v1), which caps what RAM we may use."""
    for p in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            raw = Path(p).read_text().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < 1 << 60:
            return int(raw)
    return None


def cpu_features() -> frozenset[str]:
    """SIMD features from /proc/cpuinfo ``flags`` (x86) or ``Features`` (Arm)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key.strip() in ("flags", "Features"):
                flags = set(rest.split())
                if "asimd" in flags:
                    flags.add("neon")
                return frozenset(flags)
    except OSError:
        pass
    return frozenset()


def detect_gpus() -> tuple[GPU, ...]:
    """NVIDIA GPUs through llama.cpp's device registry when this llama.cpp build offloads
    to one, else through torch.cuda (free memory is what other processes left).

    llama.cpp first, and torch not even asked then: asking torch for free memory creates
    torch's CUDA context, and a CUDA build of llama.cpp loading a model in a process that
    holds one dies of SIGSEGV in the load (seen on an H200: ``tandem run`` plans, then
    loads, in one process). Where llama.cpp cannot offload, the GPU is for the torch
    engine, and torch is the one to ask."""
    if not (Path("/dev/nvidiactl").exists() or os.environ.get("TANDEM_PROBE_CUDA")):
        return ()
    return _llama_gpus() or _torch_gpus()


LLAMA_GPU_BANDWIDTH = 300.0
"""GB/s assumed for a GPU only llama.cpp reports (it gives no memory clock or bus width)."""


def _llama_gpus() -> tuple[GPU, ...]:

    return tuple(GPU(d.description or d.name, d.total_bytes, d.free_bytes, LLAMA_GPU_BANDWIDTH, index=i)
                 for i, d in enumerate(llama_devices.gpu_devices()) if d.total_bytes)


def _torch_gpus() -> tuple[GPU, ...]:
    try:
        import torch  # local and only on a machine with an NVIDIA driver: seconds to import
    except ImportError:  # torch is the [torch]/[gpu] extra: without it, no GPU is used
        return ()
    if not torch.cuda.is_available():
        return ()
    out = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        props = torch.cuda.get_device_properties(i)
        # Peak = 2 (DDR) * clock * bus width; torch exposes both on recent versions.
        clock = getattr(props, "memory_clock_rate", 0)  # kHz
        bus = getattr(props, "memory_bus_width", 0)  # bits
        bw = 2 * clock * 1e3 * bus / 8 / 1e9 if clock and bus else 300.0
        out.append(GPU(props.name, int(total), int(free), bw, index=i))
    return tuple(out)


def _cached_bandwidth() -> float:
    """This machine's memory bandwidth, measured once and cached with its process
    baseline (:mod:`tandem.runtime.planning.baseline`): a fresh measurement moves by
    10-20 % between calls, and so would every predicted speed."""
    return machine_baseline().bandwidth_gbs


def detect(*, measure_bandwidth: bool = True) -> Machine:
    """This machine, as it is now (available RAM and free VRAM change over time)."""
    total, available = _meminfo()
    limit = cgroup_memory_limit()
    notes = []
    if limit is not None and limit < total:
        notes.append(f"container memory limit {format_size(limit)}")
        total, available = limit, min(available, limit)
    bw = _cached_bandwidth() if measure_bandwidth else 20.0
    return Machine("this machine", cpu_cores(), cpu_features(), total, available, bw,
                   gpus=detect_gpus(), notes=tuple(notes))


def from_profile(name: str) -> Machine:
    try:
        p = PROFILES[name]
    except KeyError:
        raise TandemError(f"Unknown machine profile {name!r}; choose one of {', '.join(PROFILES)}.") from None
    gpus = (p.gpu,) if p.gpu else ()
    return Machine(name, p.cpu_cores, p.cpu_features, p.ram_total, p.host_budget, p.ram_bandwidth_gbs,
                   gpus=gpus, host_budget=p.host_budget, source=f"profile {name}",
                   notes=(p.description,))


def with_budgets(machine: Machine, budget: int | str | None = None, vram: int | str | None = None) -> Machine:
    """Fill in host and device budgets: the user's if given, else the defaults
    (:data:`HOST_HEADROOM` of available RAM, :data:`VRAM_HEADROOM` of free VRAM).

    ``--vram`` on a machine without a GPU describes a hypothetical one (planning only).
    On unified memory the device budget is carved out of the host budget.
    """
    host = parse_size(budget) if budget is not None else (
        machine.host_budget or int(machine.ram_available * HOST_HEADROOM))
    if budget is not None and host < 16 * MiB:
        raise TandemError(f"A budget of {format_size(host)} cannot hold any model: write a unit, e.g. --budget 6GiB.")
    gpus = machine.gpus
    if vram is not None:
        v = parse_size(vram)
        if gpus:
            gpus = (replace(gpus[0], free_bytes=min(v, gpus[0].free_bytes) if machine.source == "detected" else v),
                    *gpus[1:])
        else:
            gpus = (GPU("hypothetical GPU (--vram)", v, v, 300.0),)
        vram_budget = v
    else:
        g = gpus[0] if gpus else None
        vram_budget = int(g.free_bytes * VRAM_HEADROOM) if g else 0
    if gpus and gpus[0].unified:
        vram_budget = min(vram_budget, host)
    return replace(machine, gpus=gpus, host_budget=host, vram_budget=vram_budget)


def resolve_machine(profile: str | None = None, budget: int | str | None = None,
                    vram: int | str | None = None, *, measure_bandwidth: bool = True) -> Machine:
    """The machine to plan for, with budgets: a named profile or this one, plus overrides."""
    base = from_profile(profile) if profile else detect(measure_bandwidth=measure_bandwidth)
    return with_budgets(base, budget, vram)


# -- this process ---------------------------------------------------------------------
