"""Where the drafter runs, and whether it pre-drafts, chosen from measured per-device costs.

The memory planner says which devices a drafter *fits* on (``plan.draft.devices``); which
one is *faster* depends on the machine, so it is measured (Dovetail, algorithms.md §2):
once per (target, drafter, machine, threads), a short calibration times

* the target: one decode step and one verification of ``k`` drafts (``k + 1`` rows),
* each candidate drafter: seconds per drafted token, and its greedy acceptance against
  the target's own continuation,

at every thread count an option needs, and caches them in ``cache_dir()/placement.json``.
Each option is then priced with the round model the speculative loop obeys, and the
fastest is used:

* sequential: a round costs ``k·t_draft + t_verify`` and yields ``E(α, k)`` tokens;
* pre-drafting (PEARL, the drafter on its own device or thread group): when the round
  accepts everything and the drafter guessed the bonus token (probability ``α^(k+1)``),
  the next round was drafted during verification and the round costs
  ``max(t_verify, (k+1)·t_draft)``; otherwise it costs what a sequential round does.

The output never depends on the choice (the target verifies every token); only speed does.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tandem.kernels.sampling import Sampler, SamplingParams
from tandem.models import paths
from tandem.runtime.backend import Backend, common_prefix_len, prefill
from tandem.runtime.drafters.base import Drafter
from tandem.runtime.split import set_threads

CALIBRATION_K = 4
"""Draft length the options are compared at (the adaptive policy still picks k later)."""
CALIBRATION_TOKENS = 24
"""Target tokens generated to time decode steps and to score drafts against."""


@dataclass(frozen=True)
class Option:
    """One way to run the pair: the drafter's device, thread counts, and pre-drafting."""

    name: str
    draft_device: str
    target_threads: int
    draft_threads: int
    predraft: bool


@dataclass
class Costs:
    """Measured seconds; keys are thread counts (and devices for the drafter)."""

    decode_s: dict[str, float] = field(default_factory=dict)
    """target threads -> one decode step."""
    verify_s: dict[str, float] = field(default_factory=dict)
    """target threads -> one verification of ``CALIBRATION_K`` drafts."""
    draft_s: dict[str, float] = field(default_factory=dict)
    """``device/threads`` -> seconds per drafted token."""
    acceptance: dict[str, float] = field(default_factory=dict)
    """``device`` -> greedy acceptance rate of single drafted tokens."""


@dataclass
class Choice:
    option: Option
    predicted: dict[str, float]
    """option name -> predicted tokens/s."""
    plain: float
    """predicted tokens/s of the target alone (the same measurement's decode step)."""
    costs: Costs
    cached: bool = False

    def as_dict(self) -> dict:
        return {"placement": self.option.name, "draft_device": self.option.draft_device,
                "predraft": self.option.predraft, "target_threads": self.option.target_threads,
                "draft_threads": self.option.draft_threads, "cached": self.cached,
                "predicted_tokens_per_s": {k: round(v, 2) for k, v in self.predicted.items()},
                "predicted_plain_tokens_per_s": round(self.plain, 2),
                "costs": asdict(self.costs)}


def options(devices: Sequence[str], threads: int) -> list[Option]:
    """Options worth comparing for a drafter that fits on ``devices`` with ``threads`` cores:
    on a GPU with and without pre-drafting; on the CPU sequential (both use every thread in
    turn) and thread splits where drafting overlaps verification."""
    out: list[Option] = []
    if "cuda" in devices:
        out += [Option("drafter on GPU, pre-drafting", "cuda", threads, threads, True),
                Option("drafter on GPU", "cuda", threads, threads, False)]
    if "cpu" in devices:
        out.append(Option("drafter on CPU, sequential", "cpu", threads, threads, False))
        for d in sorted({1, threads // 4}):
            if 1 <= d < threads:
                out.append(Option(f"CPU split {threads - d}+{d}, pre-drafting", "cpu", threads - d, d, True))
    return out


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a round yields: accepted drafts plus the target's own token."""
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def predict(option: Option, costs: Costs, k: int = CALIBRATION_K) -> float:
    """Predicted tokens/s of ``option`` from the measured costs (module docstring's model)."""
    verify = costs.verify_s[str(option.target_threads)]
    step = costs.draft_s[f"{option.draft_device}/{option.draft_threads}"]
    alpha = costs.acceptance[option.draft_device]
    sequential = k * step + verify
    if option.predraft:
        hit = alpha ** (k + 1)
        round_s = hit * max(verify, (k + 1) * step) + (1 - hit) * sequential
    else:
        round_s = sequential
    return expected_tokens(alpha, k) / round_s


def _median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_target(target: Backend, prompt: Sequence[int], threads: Sequence[int],
                   k: int = CALIBRATION_K, n_tokens: int = CALIBRATION_TOKENS, reps: int = 5,
                   ) -> tuple[list[int], dict[str, float], dict[str, float]]:
    """The target's greedy continuation, and per thread count its decode-step and
    verify-``k`` times (medians)."""
    import numpy as np

    target.truncate(0)
    logits = prefill(target, prompt)
    out: list[int] = []
    for _ in range(n_tokens):
        out.append(int(np.argmax(logits)))
        logits = target.evaluate([out[-1]])[-1]
    base = len(prompt) + n_tokens
    block = out[-(k + 1):]
    decode, verify = {}, {}
    for t in threads:
        set_threads(target, t)

        def step(tokens=block[:1]) -> None:
            target.evaluate(tokens)
            target.truncate(base)

        def check(tokens=block) -> None:
            target.evaluate(tokens, logits_for=range(len(tokens)))
            target.truncate(base)

        step()  # warm-up at this thread count
        decode[str(t)] = _median_time(step, reps)
        verify[str(t)] = _median_time(check, reps)
    return out, decode, verify


def measure_drafter(drafter: Drafter, backend: Backend | None, prompt: Sequence[int], continuation: Sequence[int],
                    threads: Sequence[int], k: int = CALIBRATION_K) -> tuple[dict[int, float], float]:
    """Seconds per drafted token at each thread count, and greedy acceptance: the share
    of drafted tokens, up to the first mismatch, that the target's continuation agrees with."""
    sampler = Sampler(SamplingParams(temperature=0.0))
    for attr in ("stop_threshold", "budget"):
        if hasattr(drafter, attr):
            setattr(drafter, attr, None)
    context = [*prompt, *continuation]
    starts = list(range(len(prompt), len(context) - k, k))
    drafter.propose(context[:starts[0]], k, sampler)  # warm-up: prefill
    drafted = accepted = 0
    for s in starts:
        d = drafter.propose(context[:s], k, sampler)
        drafted += len(d.tokens)
        accepted += common_prefix_len(d.tokens, context[s:s + k])
    per_token: dict[int, float] = {}
    s = starts[-1]
    drafter.propose(context[:s], k, sampler)
    for t in threads:
        if backend is not None:
            set_threads(backend, t)
        per_token[t] = _median_time(lambda: drafter.propose(context[:s], k, sampler), 5) / k
    return per_token, accepted / max(drafted, 1)


def calibration_key(target_path: str, draft_path: str, opts: Sequence[Option], mode: str) -> str:
    """Same files, same machine, same candidates -> the cached costs apply."""

    def ident(p: str) -> str:
        st = Path(p).stat()
        return f"{Path(p).resolve()}:{st.st_size}:{int(st.st_mtime)}"

    gpu = ""
    if any(o.draft_device == "cuda" for o in opts):
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    raw = "|".join([ident(target_path), ident(draft_path), mode, platform.node(), str(os.cpu_count()), gpu,
                    *(o.name for o in opts)])
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _cache_file() -> Path:
    return paths.cache_dir() / "placement.json"


def choose(opts: Sequence[Option], costs: Costs) -> Choice:
    predicted = {o.name: predict(o, costs) for o in opts}
    best = max(opts, key=lambda o: predicted[o.name])
    t = str(best.target_threads)
    return Choice(best, predicted, 1.0 / costs.decode_s[t], costs)


def _stderr(message: str) -> None:
    print(f"tandem: {message}", file=sys.stderr)


def calibrate(target: Backend, target_path: str, planned, opts: Sequence[Option], *, mode: str = "auto",
              prompt: Sequence[int] | None = None, use_cache: bool = True,
              notify: Callable[[str], None] = _stderr) -> Choice:
    """Measure (or read from the cache) the costs every option needs and choose.

    ``planned`` is the planner's drafter plan (:class:`~tandem.runtime.planner.ModelPlan`):
    the drafter is measured as it will run (its file, possibly a quantized copy, and
    the llama.cpp or torch config the planner priced)."""
    draft_path = planned.path
    from tandem.runtime.speculative import open_model_drafter

    key = calibration_key(target_path, draft_path, opts, mode)
    cache = _cache_file()
    try:
        data = json.loads(cache.read_text()) if cache.exists() else {}
    except (OSError, json.JSONDecodeError):
        data = {}
    if use_cache and key in data:
        choice = choose(opts, Costs(**data[key]))
        choice.cached = True
        return choice
    if prompt is None:
        prompt = target.tokenize("Once upon a time, there was a little girl who", add_bos=True)
    notify("measuring drafter placements (once for this pair and machine)")
    target_threads = sorted({o.target_threads for o in opts})
    continuation, decode, verify = measure_target(target, prompt, target_threads)
    costs = Costs(decode, verify)
    for device in dict.fromkeys(o.draft_device for o in opts):
        drafter = open_model_drafter(target, draft_path, mode, llama_config=planned.llama_config(), device=device,
                                     torch_config=planned.torch_config(device) if device == "cuda" else None)
        try:
            backend = getattr(drafter, "backend", None)
            threads = sorted({o.draft_threads for o in opts if o.draft_device == device})
            per_token, alpha = measure_drafter(drafter, backend if device == "cpu" else None, prompt,
                                               continuation, threads if device == "cpu" else threads[:1])
        finally:
            drafter.close()
        for t in threads:
            costs.draft_s[f"{device}/{t}"] = per_token.get(t, next(iter(per_token.values())))
        costs.acceptance[device] = alpha
    target.truncate(0)
    set_threads(target, max(target_threads))
    data[key] = asdict(costs)
    with contextlib.suppress(OSError):  # a read-only cache only costs a re-measurement next time
        cache.write_text(json.dumps(data, indent=1))
    return choose(opts, costs)


@dataclass
class Placed:
    """What the speculative strategy needs from the planned, chosen placement."""

    draft_path: str | None = None
    """The drafter file the planner priced (maybe its quantized copy); ``None``: as given."""
    llama_config: object | None = None
    """The drafter's :class:`~tandem.runtime.llama_backend.LlamaConfig` with its thread count."""
    torch_config: object | None = None
    """The :class:`~tandem.runtime.torch_engine.backend.TorchConfig` priced for a GPU drafter."""
    draft_device: str = "cpu"
    predraft: bool | None = None
    """``None`` leaves the strategy's default (on for a GPU drafter)."""
    choice: Choice | None = None
    """The calibration behind it; ``None`` when there was only one option."""
    draft_cost: float | None = None
    """Measured drafter seconds per token / target decode step, for the adaptive policy."""


DEVICE_CHOICES = ("auto", "gpu", "cpu")


def place(target: Backend, target_path: str, planned, *, mode: str = "auto", device: str = "auto",
          use_cache: bool = True, notify: Callable[[str], None] = _stderr) -> Placed:
    """Choose the drafter's placement for ``planned`` (the planner's drafter plan):
    calibrate when it fits on more than one device or the CPU threads can be split,
    restricted to ``device`` (``gpu``/``cpu``) when the user asks, and apply the thread
    counts to the target (in place) and the drafter's config."""
    from dataclasses import replace

    from tandem.models.errors import TandemError
    from tandem.runtime.llama_backend import default_threads

    threads = planned.n_threads or default_threads()
    wanted = {"auto": planned.devices, "gpu": ("cuda",), "cpu": ("cpu",)}[device]
    devices = tuple(d for d in planned.devices if d in wanted)
    if not devices:
        raise TandemError(f"The drafter cannot run on the {device.upper()} here: the plan allows "
                          f"{', '.join(planned.devices)}.")
    opts = options(devices, threads)
    choice = (calibrate(target, target_path, planned, opts, mode=mode, use_cache=use_cache, notify=notify)
              if len(opts) > 1 else None)
    best = choice.option if choice is not None else opts[0]
    set_threads(target, best.target_threads)
    cost = None
    if choice is not None:
        c = choice.costs
        cost = c.draft_s[f"{best.draft_device}/{best.draft_threads}"] / c.decode_s[str(best.target_threads)]
    return Placed(planned.path, replace(planned.llama_config(), n_threads=best.draft_threads),
                  planned.torch_config("cuda") if best.draft_device == "cuda" else None,
                  best.draft_device, best.predraft, choice, cost)
