"""The short calibration behind :mod:`tandem.runtime.planning.placement`, and :func:`place`,
which applies its choice. Measured once per (target, drafter, machine, options), cached in
``cache_dir()/placement.json``.

It times, on each device and thread count some option needs,

* the target: one decode step and one verification of ``k`` drafts (``k + 1`` rows) —
  llama.cpp on CPU threads, and the torch engine on the GPU when an option puts the
  target there;
* the drafter: seconds per drafted token, and its greedy acceptance against the
  target's own continuation.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.models import paths
from tandem.runtime.backends.protocol import Backend, common_prefix_len, prefill
from tandem.runtime.machine import machine_id
from tandem.runtime.planning.placement import (
    CALIBRATION_K,
    CALIBRATION_TOKENS,
    Choice,
    Costs,
    Option,
    Placed,
    choose,
    draft_key,
    plan_options,
    target_key,
)
from tandem.runtime.speculative.drafter_model import open_draft_backend, open_model_drafter
from tandem.runtime.speculative.drafters.base import Drafter


def _median_time(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def continuation(target: Backend, prompt: Sequence[int], n_tokens: int = CALIBRATION_TOKENS) -> list[int]:
    """The target's greedy continuation of ``prompt`` (what drafts are scored against);
    leaves the target holding ``prompt + continuation``."""
    target.truncate(0)
    logits = prefill(target, prompt)
    out: list[int] = []
    for _ in range(n_tokens):
        out.append(int(np.argmax(logits)))
        logits = target.evaluate([out[-1]])[-1]
    return out


def measure_target(target: Backend, context: Sequence[int], threads: dict[str, int | None],
                   k: int = CALIBRATION_K, reps: int = 5) -> tuple[dict[str, float], dict[str, float]]:
    """Decode-step and verify-``k`` seconds (medians) for each ``key -> threads`` (``None``:
    the backend as it is, e.g. the torch engine on a GPU), after ``context``."""
    if target.tokens != list(context):
        target.truncate(0)
        prefill(target, context, keep_last=False)
    base = len(context)
    block = list(context[-(k + 1):])
    decode, verify = {}, {}
    for key, t in threads.items():
        if t is not None:
            target.set_threads(t)

        def step(tokens=block[:1]) -> None:
            target.evaluate(tokens)
            target.truncate(base)

        def check(tokens=block) -> None:
            target.evaluate(tokens, logits_for=range(len(tokens)))
            target.truncate(base)

        for _ in range(3):  # warm-up at this thread count (and a GPU's first launches of each shape)
            step()
            check()
        decode[key] = _median_time(step, reps)
        verify[key] = _median_time(check, reps)
    return decode, verify


def measure_drafter(drafter: Drafter, backend: Backend | None, prompt: Sequence[int], continued: Sequence[int],
                    threads: Sequence[int], k: int = CALIBRATION_K) -> tuple[dict[int, float], float]:
    """Seconds per drafted token at each thread count, and greedy acceptance: the share
    of drafted tokens, up to the first mismatch, that the target's continuation agrees with."""
    sampler = Sampler(SamplingParams(temperature=0.0))
    drafter.stop_threshold = None  # timed at full length
    context = [*prompt, *continued]
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
            backend.set_threads(t)
        per_token[t] = _median_time(lambda: drafter.propose(context[:s], k, sampler), 5) / k
    return per_token, accepted / max(drafted, 1)


def calibration_key(plan, opts: Sequence[Option], mode: str) -> str:
    """Same files, same machine, same candidates, and the same llama.cpp placement (each
    model's GPU layers and the target's KV type, which the measured costs depend on: a
    target bigger than the GPU budget placed another way, ``--offload``, is measured
    anew) -> the cached costs apply."""

    def ident(p: str) -> str:
        st = Path(p).stat()
        return f"{Path(p).resolve()}:{st.st_size}:{int(st.st_mtime)}"

    gpu = ""
    if any("cuda" in (o.draft_device, o.target_device) for o in opts):
        import torch  # local: a CUDA option exists only where torch found the GPU

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    placed = f"gpu layers {plan.target.n_gpu_layers}+{plan.draft.n_gpu_layers}, kv {plan.target.type_k}"
    raw = "|".join([ident(plan.target.path), ident(plan.draft.path), mode, machine_id(), gpu, placed,
                    *(o.name for o in opts)])
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _cache_file() -> Path:
    return paths.cache_dir() / "placement.json"


def _stderr(message: str) -> None:
    print(f"tandem: {message}", file=sys.stderr)


def calibrate(target: Backend, plan, opts: Sequence[Option], *, mode: str = "auto",
              prompt: Sequence[int] | None = None, use_cache: bool = True,
              notify: Callable[[str], None] = _stderr, keep: dict[str, Backend] | None = None) -> Choice:
    """Measure (or read from the cache) the costs every option needs and choose.

    ``plan`` is the planner's :class:`~tandem.runtime.planning.plan.Plan`; ``target`` its target,
    open in llama.cpp. The drafter is measured as it will run (its file, possibly a
    quantized copy, and the llama.cpp or torch config the planner priced); a target on
    the GPU is opened in the torch engine for the measurement. With ``keep`` the backends
    opened for measuring are handed over in it (``draft:cpu``, ``draft:cuda``,
    ``target:cuda``) instead of being closed, so the caller does not open them again."""
    draft = plan.draft
    key = calibration_key(plan, opts, mode)
    cache = _cache_file()
    try:
        data = json.loads(cache.read_text()) if cache.exists() else {}
    except (OSError, json.JSONDecodeError):
        data = {}
    if use_cache and key in data:
        try:
            choice = choose(opts, Costs(**data[key]))
        except (KeyError, TypeError):
            pass  # written by an older layout of the costs: measure again
        else:
            choice.cached = True
            return choice
    if prompt is None:
        prompt = target.tokenize("Once upon a time, there was a little girl who", add_bos=True)
    notify("measuring drafter placements (once for this pair and machine)")
    continued = continuation(target, prompt)
    context = [*prompt, *continued]
    cpu = {target_key(o): o.target_threads for o in opts if o.target_device == "cpu"}
    costs = Costs(*measure_target(target, context, cpu))
    if any(o.target_device == "cuda" for o in opts):
        # local: loads llama.cpp and torch only when this runs
        from tandem.runtime.backends.torch_engine.backend import TorchBackend

        on_gpu = TorchBackend(plan.target.path, plan.target.torch_config("cuda"))
        try:
            decode, verify = measure_target(on_gpu, context, {"cuda": None})
            on_gpu.truncate(0)
        finally:
            _keep_or_close(keep, "target:cuda", on_gpu)
        costs.decode_s.update(decode)
        costs.verify_s.update(verify)
    for device in dict.fromkeys(o.draft_device for o in opts):
        backend = open_draft_backend(target, draft.path, llama_config=draft.llama_config(), device=device,
                                     torch_config=draft.torch_config(device) if device == "cuda" else None)
        try:
            drafter = open_model_drafter(target, backend, mode)  # the backend stays ours
            threads = sorted({o.draft_threads for o in opts if o.draft_device == device})
            on_cpu = device == "cpu"
            per_token, alpha = measure_drafter(drafter, backend if on_cpu else None,
                                               prompt, continued, threads if on_cpu else threads[:1])
            drafter.close()
            backend.truncate(0)
        finally:
            _keep_or_close(keep, f"draft:{device}", backend)
        for t in threads:
            costs.draft_s[draft_key(device, t)] = per_token.get(t, next(iter(per_token.values())))
        costs.acceptance[device] = alpha
    target.truncate(0)
    target.set_threads(max(cpu.values(), default=plan.target.n_threads or 1))
    data[key] = asdict(costs)
    paths.write_cache_file(cache, json.dumps(data, indent=1))  # atomic; failing costs a re-measurement
    return choose(opts, costs)


def _keep_or_close(keep: dict[str, Backend] | None, key: str, backend: Backend) -> None:
    if keep is None:
        backend.close()
    else:
        keep[key] = backend


def place(target: Backend, plan, *, mode: str = "auto", device: str = "auto", use_cache: bool = True,
          notify: Callable[[str], None] = _stderr, keep_drafter: bool = False) -> Placed:
    """Choose the placement for ``plan`` (the planner's :class:`~tandem.runtime.planning.plan.Plan`
    with a drafter; ``target`` is its target, open in llama.cpp): calibrate when there is
    more than one option, restricted by ``device`` (see :data:`~tandem.runtime.choices.DEVICE_CHOICES`), then
    apply it — thread counts set on the target, the drafter's configs, and the target
    moved to the torch engine on the GPU when that is the choice (the llama.cpp one is
    closed; the one the calibration measured is reused). ``keep_drafter``: hand over the
    drafter backend the calibration opened on the chosen device (``Placed.draft_backend``,
    the caller's to close) instead of closing it."""
    draft = plan.draft
    opts = plan_options(plan, device)
    choice = None
    opened: dict[str, Backend] = {}
    try:
        if len(opts) > 1:
            choice = calibrate(target, plan, opts, mode=mode, use_cache=use_cache, notify=notify, keep=opened)
        best = choice.option if choice is not None else opts[0]
        target.set_threads(best.target_threads)
        if best.target_device == "cuda":
            # local: loads llama.cpp and torch only when this runs
            from tandem.runtime.backends.torch_engine.backend import TorchBackend

            target.close()
            target = opened.pop("target:cuda", None) or TorchBackend(plan.target.path, plan.target.torch_config("cuda"))
        draft_backend = opened.pop(f"draft:{best.draft_device}", None) if keep_drafter else None
        if draft_backend is not None:
            draft_backend.set_threads(best.draft_threads)
    finally:
        for backend in opened.values():
            backend.close()
    cost = None
    if choice is not None:
        c = choice.costs
        cost = c.draft_s[draft_key(best.draft_device, best.draft_threads)] / c.decode_s[target_key(best)]
    return Placed(target, draft.path, replace(draft.llama_config(), n_threads=best.draft_threads),
                  draft.torch_config("cuda") if best.draft_device == "cuda" else None,
                  best.draft_device, best.predraft, choice, cost, draft_backend)
