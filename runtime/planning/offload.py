"""A target bigger than the GPU budget: three placements, priced alike and compared.

When the target does not fit ``--vram`` whole, there are three ways to run it, each with
the drafter on the GPU where it fits (it is small, and there it costs a few hundredths
of a target step):

a. **partial offload** (llama.cpp's ``n_gpu_layers``): as many of the target's layers on
   the GPU as fit next to the drafter, the rest on CPU threads;
b. **the target on CPU threads**, the GPU the drafter's alone (Dovetail's placement);
c. **a quantized KV cache** (q8_0, then q4_0) for the target, so that more of its layers
   fit on the GPU.

Each is priced by the same memory model (:func:`~tandem.runtime.planning.memory_model.estimate`;
it must fit both budgets) and the same cost model (:mod:`tandem.runtime.planning.speed`:
plain and speculative tokens/s from each device's bandwidth, the GPU's launch cost per
layer, the drafter's step and the acceptance), and the fastest that fits wins.

A quantized KV cache changes the target's output (:data:`~tandem.runtime.planning.plan.KV_QUALITY`),
so (c) is a candidate only where KV quantization is allowed (``allow_kv_quant``, no fixed
``--kv-type``), and it wins only when it is predicted :data:`KV_GAIN` times faster than
the best placement without it; the plan then says what it costs. Lossless speculation is
unchanged by the choice: the target verifies every token wherever it runs.

``--offload NAME`` (:attr:`~tandem.runtime.planning.plan.PlanRequest.offload`) takes one
placement instead of the fastest: it is priced as the others are, and must fit and be
allowed; otherwise the plan is refused with why, naming those that would do. That is how
``tandem bench --gpu --vram`` opens each placement as `tandem run` would.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tandem.errors import TandemError
from tandem.runtime.choices import LLAMA_KV_TYPES, OFFLOAD_CHOICES
from tandem.runtime.planning.devices import fits, max_gpu_layers, place_on_gpu, rooms
from tandem.runtime.planning.hardware import Machine, format_size
from tandem.runtime.planning.memory_model import Estimate, estimate
from tandem.runtime.planning.plan import KV_QUALITY, ModelPlan, OffloadOption
from tandem.runtime.planning.shapes import ModelShape
from tandem.runtime.planning.speed import predict

KV_GAIN = {"q8_0": 1.02, "q4_0": 1.10}
"""How much faster than the best placement with the requested KV type a quantized KV
cache must be predicted to run before it is chosen: q8_0 costs almost nothing (next-token
agreement with f16 1.000), so any real gain; q4_0 changes about 6 % of next tokens, so
only a clear one (predictions are not measurements: a few percent is within their error)."""
PINNED = "pinned by --offload"
"""The pinned placement's note begins so."""


@dataclass(frozen=True)
class Placed:
    """One candidate: what the plan would hold, and its priced summary."""

    option: OffloadOption
    target: ModelPlan
    draft: ModelPlan | None
    memory: Estimate


@dataclass(frozen=True)
class Pair:
    """What a rung of the planner's ladder settled, before the target is placed: the
    target's and drafter's settings (``draft`` ``None``: no draft model) and the budgets."""

    machine: Machine
    baseline: int
    t_shape: ModelShape
    target: ModelPlan
    k: int
    d_shape: ModelShape | None = None
    draft: ModelPlan | None = None
    alpha: float = 0.7


def needs_comparing(target: ModelPlan) -> bool:
    """Whether the placed target is bigger than the GPU budget (some layers on the CPU)."""
    return target.n_gpu_layers >= 0


def check_pin(pin: str | None) -> None:
    """Refuse an ``--offload`` that names no placement, before anything is priced."""
    if pin is not None and pin not in OFFLOAD_CHOICES:
        raise TandemError(f"Unknown --offload {pin!r}; choose one of {', '.join(OFFLOAD_CHOICES)} "
                          "(a partial offload, b target on CPU threads, c-KV a quantized KV cache).")


def compare(pair: Pair, kv_types: list[str], allow_kv_quant: bool, kv_fixed: bool,
            pin: str | None = None) -> list[Placed]:
    """Every placement priced, the winner marked (``option.chosen``); ``kv_types``: the KV
    types the request allows, best first (the ladder's rung uses ``pair.target``'s);
    ``pin``: the winner named by ``--offload`` instead of the fastest (:func:`pinned`)."""
    kv = pair.target.type_k
    cands = [_priced(pair, "a", "partial offload", kv, on_gpu=True),
             _priced(pair, "b", "target on CPU threads", kv, on_gpu=False)]
    for q in LLAMA_KV_TYPES[LLAMA_KV_TYPES.index(kv) + 1:] if kv in LLAMA_KV_TYPES else ():
        name = f"{q} KV cache, partial offload"
        if not pair.t_shape.kv_type_ok(q):  # llama.cpp refuses the context: nothing to price
            note = f"not possible: {q} stores blocks of 32 values but the attention heads have {pair.t_shape.head_dim}"
            cands.append(Placed(OffloadOption("c", name, q, False, quality=KV_QUALITY[q], allowed=False, note=note),
                                pair.target, pair.draft, Estimate()))
            continue
        cand = _priced(pair, "c", name, q, on_gpu=True)
        why_not = _kv_refusal(q, kv_types, allow_kv_quant, kv_fixed)
        if not why_not and cand.option.fits and _layers(cand.option, pair.t_shape) <= _layers(cands[0].option, pair.t_shape):
            why_not = (f"no more of the target's layers fit on the GPU than with a {kv} KV cache: "
                       "nothing gained for its quality cost")
        if why_not:
            cand = replace(cand, option=replace(cand.option, allowed=False, note=why_not))
        cands.append(cand)
    return pinned(cands, pin) if pin is not None else _choose(cands, kv)


def _layers(option: OffloadOption, shape: ModelShape) -> int:
    """The option's ``n_gpu_layers`` as a count (-1: all of the ``n_layer + 1``)."""
    return shape.n_layer + 1 if option.n_gpu_layers < 0 else option.n_gpu_layers


def _kv_refusal(kv: str, kv_types: list[str], allow: bool, fixed: bool) -> str:
    if fixed:
        return "not compared: --kv-type fixes the KV cache type"
    if not allow or kv not in kv_types:
        return "not allowed: KV quantization is off (--no-kv-quant)"
    return ""


def _priced(pair: Pair, key: str, name: str, kv: str, *, on_gpu: bool) -> Placed:
    """One placement of ``pair`` with a ``kv`` target KV cache, priced: memory and speed."""
    machine, baseline, k = pair.machine, pair.baseline, pair.k
    target = replace(pair.target, type_k=kv, type_v=kv)
    draft = pair.draft
    if draft is not None and pair.d_shape is not None:
        target, draft, memory = place_on_gpu(machine, baseline, pair.t_shape, target, k, pair.d_shape, draft,
                                             target_on_gpu=on_gpu)
    else:
        g = max_gpu_layers(pair.t_shape, target.setup(k + 1), machine, baseline, Estimate()) if on_gpu else 0
        target = replace(target, n_gpu_layers=g)
        memory = estimate(pair.t_shape, target.setup(k + 1), k=k)
    ok = fits(memory, machine, baseline)
    speed = predict(machine, pair.t_shape, target.setup(), pair.alpha, k, pair.d_shape,
                    draft.setup() if draft is not None else None)
    plain = speed.plain
    speedup = max(1.0, speed.speedup)  # the policy drafts only where it pays
    option = OffloadOption(key, name, kv, ok, target.n_gpu_layers, None if draft is None else draft.n_gpu_layers,
                           baseline + memory.host, memory.gpu, plain, plain * speedup, KV_QUALITY[kv],
                           note="" if ok else _overflow(memory, machine, baseline))
    return Placed(option, target, draft, memory)


def _overflow(est: Estimate, machine: Machine, baseline: int) -> str:
    """Which budget a placement misses, and by how much."""
    host_room, gpu_room = rooms(machine, baseline)
    gpu = machine.gpu
    misses = []
    if est.host > host_room or (gpu is not None and gpu.unified and est.host + est.gpu > host_room):
        misses.append(f"{format_size(baseline + est.host)} of host memory, over the {format_size(machine.host_budget)} "
                      "budget" + (" less what is kept free" if est.host <= machine.host_budget - baseline else ""))
    if est.gpu > gpu_room:
        misses.append(f"{format_size(est.gpu)} of GPU memory, over the {format_size(machine.vram_budget)} budget")
    return "does not fit: needs " + " and ".join(misses or ["more memory than the budgets hold"])


def _speed(p: Placed) -> float:
    return p.option.speculative_tokens_per_s


def _choose(cands: list[Placed], kv: str) -> list[Placed]:
    """The fastest placement that fits and is allowed; a quantized KV cache only by
    :data:`KV_GAIN`. Every candidate's note says why it won or lost."""
    eligible = [c for c in cands if c.option.fits and c.option.allowed]
    plain_kv = [c for c in eligible if c.option.type_k == kv]
    if not plain_kv:  # the ladder's rung fits as (a): this only guards a misuse
        return cands
    best = max(plain_kv, key=_speed)
    winner = best
    for c in eligible:
        if c.option.type_k != kv and _speed(c) >= KV_GAIN[c.option.type_k] * _speed(best) and _speed(c) > _speed(winner):
            winner = c
    out = []
    for c in cands:
        o = c.option
        if c is winner:
            o = replace(o, chosen=True, note=_winner_note(c, best, eligible, kv))
        elif o.fits and o.allowed:
            note = f"{_speed(c) / _speed(winner):.2f}x the chosen placement"
            if o.type_k != kv and _speed(c) > _speed(winner):
                note += (f": faster, but under the {KV_GAIN[o.type_k]:.2f}x over {kv} a {o.type_k} KV cache must "
                         f"gain for its quality cost ({o.quality})")
            o = replace(o, note=note)
        out.append(replace(c, option=o))
    return out


def pinned(cands: list[Placed], pin: str) -> list[Placed]:
    """``cands`` with the placement ``pin`` names marked chosen; a :class:`TandemError`
    (one line, with the placements that would do) when it was not compared, does not
    fit or is not allowed: never another placement in its place."""
    check_pin(pin)
    usable = [c.option.pin for c in cands if c.option.fits and c.option.allowed]
    choices = f"placements that fit here: {', '.join(usable)}" if usable else "no placement fits here"
    win = next((c for c in cands if c.option.pin == pin), None)
    if win is None:
        raise TandemError(f"--offload {pin}: that placement is not compared for this target (the target's KV "
                          f"cache is already {cands[0].option.type_k}); {choices}.")
    if not win.option.fits or not win.option.allowed:
        raise TandemError(f"--offload {pin} ({win.option.name}, {win.option.type_k} KV): {win.option.note}; "
                          f"{choices}.")
    out = []
    for c in cands:
        o = c.option
        if c is win:
            o = replace(o, chosen=True, note=f"{PINNED}; {o.quality}")
        elif o.fits and o.allowed:
            o = replace(o, note=f"{_speed(c) / max(_speed(win), 1e-9):.2f}x the pinned placement")
        out.append(replace(c, option=o))
    return out


def _winner_note(winner: Placed, best: Placed, eligible: list[Placed], kv: str) -> str:
    """Why ``winner`` won: against the next fastest, and for a quantized KV cache its gain
    over ``best`` (the fastest with the requested type) and its quality cost."""
    slower = [c for c in eligible if c is not winner and _speed(c) <= _speed(winner)]
    fastest = len(slower) == len(eligible) - 1
    note = "the fastest that fits" if fastest else "the fastest that fits once a quantized KV cache's required gain is counted"
    if slower:
        runner = max(slower, key=_speed)
        note += f": {_speed(winner) / max(_speed(runner), 1e-9):.2f}x the next, {runner.option.key} ({runner.option.type_k})"
    else:
        note += ": the only one"
    o = winner.option
    if o.type_k != kv:
        note += (f"; {_speed(winner) / _speed(best):.2f}x the best {kv} placement, over the {KV_GAIN[o.type_k]:.2f}x "
                 f"a {o.type_k} KV cache must gain; quality: {o.quality}")
    return note


def summary(options: list[OffloadOption]) -> str:
    """One line for the plan's reasons: which placement won and how the others fared."""
    win = next((o for o in options if o.chosen), None)
    if win is None:
        return "the target does not fit the GPU budget whole, and no placement compared fits"
    parts = []
    for o in options:
        state = (f"~{o.speculative_tokens_per_s:.1f} tok/s" if o.fits else "does not fit") + ("" if o.allowed else
                                                                                           ", not allowed")
        parts.append(f"{o.key} {o.name} ({o.type_k}) {state}")
    how = "pinned by --offload" if win.note.startswith(PINNED) else "chosen"
    return (f"the target does not fit the GPU budget whole: placement {win.pin} ({win.name}) {how}, predicted "
            f"~{win.speculative_tokens_per_s:.1f} tok/s; compared: " + "; ".join(parts))
