"""A target bigger than the GPU budget: partial offload (a), the target on CPU threads (b)
and a quantized KV cache (c) are each priced with the memory model and the cost model,
and the fastest that fits wins, a quality-costing KV cache only where it is allowed.

Real shapes: Qwen2.5-7B's header (Q4_K_M bytes, no weights) with the real
Qwen2.5-Coder-0.5B as its drafter, planned for a profile's GPU at a 3 GiB budget (a
profile's GPU offloads whatever this machine's build can do). No timing here: predicted
speeds only."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from real_shapes import qwen7b_header

from tandem.errors import TandemError
from tandem.runtime.planning.devices import SAFETY
from tandem.runtime.planning.hardware import GiB, resolve_machine
from tandem.runtime.planning.memory_model import Setup
from tandem.runtime.planning.offload import KV_GAIN
from tandem.runtime.planning.plan import KV_QUALITY, Plan, PlanRequest
from tandem.runtime.planning.planner import make_plan
from tandem.runtime.planning.shapes import shape_from_gguf
from tandem.runtime.planning.speed import GPU_COST_CURVE, read_bytes, step_cost
from tandem.runtime.speculative.cost import CPU_COST_CURVE


@pytest.fixture(scope="module")
def qwen7b(real_models, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return qwen7b_header(tmp_path_factory.mktemp("shapes"), real_models.qwen_05b)


def _machine(vram: str = "3GiB", budget: str | None = None, gpu_gbs: float | None = None):
    machine = resolve_machine("rtx3060-laptop", budget, vram)
    if gpu_gbs is not None:
        machine = replace(machine, gpus=(replace(machine.gpus[0], bandwidth_gbs=gpu_gbs),))
    return machine


def _plan(target: Path, draft: Path | None, machine, ctx: int = 4096, **kw) -> Plan:
    return make_plan(PlanRequest(target, draft, ctx, machine, model_free=False, **kw))


def _speed(o) -> float:
    return o.speculative_tokens_per_s


def _eligible(plan: Plan):
    return [o for o in plan.placements if o.fits and o.allowed]


def test_each_placement_is_priced_and_what_fits_fits_the_budget(qwen7b: Path, real_models) -> None:
    machine = _machine()
    plan = _plan(qwen7b, real_models.qwen_05b, machine)
    assert plan.fits
    by = {(o.key, o.type_k): o for o in plan.placements}
    assert set(by) == {("a", "f16"), ("b", "f16"), ("c", "q8_0"), ("c", "q4_0")}
    for o in plan.placements:
        assert o.tokens_per_s > 0 and o.speculative_tokens_per_s >= o.tokens_per_s, o
        assert o.host_bytes > plan.baseline and o.draft_gpu_layers == -1  # the small drafter wholly on the GPU
        assert o.quality == KV_QUALITY[o.type_k] and o.note
        if o.fits:
            assert o.host_bytes <= plan.host_budget and o.gpu_bytes <= plan.vram_budget * (1 - SAFETY)
    a, b = by["a", "f16"], by["b", "f16"]
    assert 0 < a.n_gpu_layers < 29 and b.n_gpu_layers == 0  # 7B at 3 GiB: part of it on the GPU
    assert b.gpu_bytes < a.gpu_bytes and b.host_bytes > a.host_bytes
    assert by["c", "q8_0"].n_gpu_layers >= a.n_gpu_layers  # a smaller KV cache leaves room for layers
    # The plan is the chosen placement, and its memory is that placement's.
    (chosen,) = [o for o in plan.placements if o.chosen]
    assert (plan.target.n_gpu_layers, plan.target.type_k) == (chosen.n_gpu_layers, chosen.type_k)
    assert plan.memory.gpu == chosen.gpu_bytes and plan.host_total == chosen.host_bytes
    assert plan.tokens_per_s * plan.speedup == pytest.approx(chosen.speculative_tokens_per_s)
    assert any("placement " + chosen.key in r for r in plan.reasons)


def test_the_winner_is_the_fastest_that_fits(qwen7b: Path, real_models) -> None:
    """Without KV quantization the choice is the fastest of what fits; a host budget too
    small for the whole target on CPU threads rules (b) out, with how much it misses."""
    plan = _plan(qwen7b, real_models.qwen_05b, _machine(), allow_kv_quant=False)
    (chosen,) = [o for o in plan.placements if o.chosen]
    assert chosen is max(_eligible(plan), key=_speed)
    assert "the fastest that fits" in chosen.note
    tight = _plan(qwen7b, real_models.qwen_05b, _machine(budget="4.5GiB"), allow_kv_quant=False)
    b = next(o for o in tight.placements if o.key == "b")
    assert not b.fits and not b.chosen and "does not fit: needs" in b.note and "host memory" in b.note
    assert b.host_bytes > 4.5 * GiB * (1 - SAFETY)
    assert tight.fits and tight.target.n_gpu_layers > 0


def test_the_relative_gpu_and_cpu_cost_flips_partial_offload_and_dovetail(qwen7b: Path, real_models) -> None:
    """A GPU much faster than host memory takes target layers (a); one slower than host
    memory (an old card over a narrow bus) is better left to the drafter alone (b). The
    drafter is kept as `tandem run` keeps a drafter the user named."""
    fast = _plan(qwen7b, real_models.qwen_05b, _machine(gpu_gbs=336.0), allow_kv_quant=False,
                 drop_slow_draft=False)
    slow = _plan(qwen7b, real_models.qwen_05b, _machine(gpu_gbs=20.0), allow_kv_quant=False,
                 drop_slow_draft=False)
    assert [o.key for o in fast.placements if o.chosen] == ["a"] and fast.target.n_gpu_layers > 0
    assert [o.key for o in slow.placements if o.chosen] == ["b"] and slow.target.n_gpu_layers == 0
    assert slow.draft is not None and slow.draft.n_gpu_layers == -1  # the drafter stays on the GPU
    for plan in (fast, slow):
        (chosen,) = [o for o in plan.placements if o.chosen]
        assert chosen is max(_eligible(plan), key=_speed)


def test_q4_0_wins_only_where_kv_quantization_is_allowed_and_says_its_cost(qwen7b: Path, real_models) -> None:
    """At a 32k context the KV cache is big enough that q4_0 buys layers on the GPU."""
    allowed = _plan(qwen7b, real_models.qwen_05b, _machine(), ctx=32768)
    (chosen,) = [o for o in allowed.placements if o.chosen]
    best_f16 = max((o for o in _eligible(allowed) if o.type_k == "f16"), key=_speed)
    assert chosen.type_k == "q4_0" and _speed(chosen) >= KV_GAIN["q4_0"] * _speed(best_f16)
    assert KV_QUALITY["q4_0"] in chosen.note and allowed.kv_note and KV_QUALITY["q4_0"] in allowed.kv_note
    assert allowed.target.type_k == "q4_0" and allowed.target.flash
    for kw in ({"allow_kv_quant": False}, {"kv_type": "f16"}):
        plan = _plan(qwen7b, real_models.qwen_05b, _machine(), ctx=32768, **kw)
        (chosen,) = [o for o in plan.placements if o.chosen]
        assert chosen.type_k == "f16" and plan.target.type_k == "f16" and plan.kv_note is None
        quantized = [o for o in plan.placements if o.key == "c"]
        assert quantized and all(not o.allowed and not o.chosen for o in quantized)
        assert any(_speed(o) > _speed(chosen) for o in quantized)  # faster, and still not taken


def test_a_small_gain_does_not_buy_a_quality_cost(qwen7b: Path, real_models) -> None:
    """At 4k the KV cache is small: q4_0 gains too little over f16 to be chosen."""
    plan = _plan(qwen7b, real_models.qwen_05b, _machine())
    q4 = next(o for o in plan.placements if o.type_k == "q4_0")
    best_f16 = max((o for o in _eligible(plan) if o.type_k == "f16"), key=_speed)
    assert _speed(q4) < KV_GAIN["q4_0"] * _speed(best_f16) and not q4.chosen
    assert plan.target.type_k != "q4_0"


def test_without_a_drafter_the_target_placements_are_still_compared(qwen7b: Path) -> None:
    plan = _plan(qwen7b, None, _machine(), allow_kv_quant=False)
    assert {o.key for o in plan.placements} == {"a", "b", "c"}
    assert all(o.draft_gpu_layers is None and o.speculative_tokens_per_s == o.tokens_per_s for o in plan.placements)
    assert [o.key for o in plan.placements if o.chosen] == ["a"]


def test_a_target_that_fits_the_card_is_not_compared(qwen7b: Path, real_models) -> None:
    plan = _plan(qwen7b, real_models.qwen_05b, _machine(vram="12GiB", budget="12GiB"))
    assert plan.fits and plan.target.n_gpu_layers == -1 and plan.placements == []


def test_step_cost_reads_each_layer_where_it_is(qwen7b: Path) -> None:
    """Every weight but the embedding (one row a token) is read once a step, on its
    device; a split step verifies at each device's share of its curve."""
    shape = shape_from_gguf(qwen7b)
    machine = _machine()
    cpu_host, cpu_gpu, _ = read_bytes(shape, Setup(256, n_gpu_layers=0))
    part_host, part_gpu, layers = read_bytes(shape, Setup(256, n_gpu_layers=5))
    assert cpu_gpu == 0 and layers == 5
    assert part_host + part_gpu == cpu_host
    assert part_gpu >= sum(shape.layer_bytes[-4:]) + shape.output_bytes
    assert cpu_host >= sum(shape.layer_bytes) + shape.output_bytes and cpu_host < shape.weights_bytes
    step = step_cost(shape, Setup(256, n_gpu_layers=5), machine)
    assert step.host_s > 0 and step.gpu_s > 0
    assert GPU_COST_CURVE(4) < step.verify(4) < CPU_COST_CURVE(4)
    assert step_cost(shape, Setup(256), machine).seconds > step.seconds


def _priced(o):
    """An option's pricing, without the marks the choice sets (``chosen``, ``note``)."""
    return replace(o, chosen=False, note="")


def test_pinning_each_placement_gives_that_placements_plan(qwen7b: Path, real_models) -> None:
    """``offload=`` takes the named placement instead of the fastest: the plan is that
    option as the comparison priced it (same rung, same layers, memory and speed), and
    every option is priced as without the pin."""
    machine = _machine()
    base = _plan(qwen7b, real_models.qwen_05b, machine)
    pins = [o.pin for o in _eligible(base)]
    assert {"a", "b", "c-q8_0"} <= set(pins) and len(set(pins)) == len(pins)
    for option in _eligible(base):
        plan = _plan(qwen7b, real_models.qwen_05b, machine, offload=option.pin)
        assert [_priced(o) for o in plan.placements] == [_priced(o) for o in base.placements]
        (chosen,) = [o for o in plan.placements if o.chosen]
        assert chosen.pin == option.pin and chosen.note.startswith("pinned by --offload")
        assert plan.target == replace(base.target, n_gpu_layers=option.n_gpu_layers, type_k=option.type_k,
                                      type_v=option.type_k)
        assert plan.draft is not None and plan.draft.n_gpu_layers == option.draft_gpu_layers
        assert replace(plan.draft, n_gpu_layers=0) == replace(base.draft, n_gpu_layers=0)
        assert plan.memory.gpu == option.gpu_bytes and plan.host_total == option.host_bytes
        assert plan.tokens_per_s * plan.speedup == pytest.approx(option.speculative_tokens_per_s)
        assert any(f"placement {option.pin} ({option.name}) pinned by --offload" in r for r in plan.reasons)
        assert (plan.kv_note is not None) == (option.type_k != "f16")
    # Pinning the planner's own pick changes nothing but the words.
    (pick,) = [o for o in base.placements if o.chosen]
    same = _plan(qwen7b, real_models.qwen_05b, machine, offload=pick.pin)
    assert (same.target, same.draft, same.memory) == (base.target, base.draft, base.memory)


def test_an_unknown_or_unusable_pin_is_refused_with_the_choices(qwen7b: Path, real_models) -> None:
    """One line that names what would do; never another placement in its place."""
    machine = _machine()
    with pytest.raises(TandemError, match=r"Unknown --offload 'd'; choose one of a, b, c-q8_0, c-q4_0") as exc:
        _plan(qwen7b, real_models.qwen_05b, machine, offload="d")
    assert "\n" not in str(exc.value)
    tight = _machine(budget="4.5GiB")  # (b) misses the host budget
    with pytest.raises(TandemError) as exc:
        _plan(qwen7b, real_models.qwen_05b, tight, allow_kv_quant=False, offload="b")
    message = str(exc.value)
    assert message.startswith("--offload b (target on CPU threads, f16 KV): does not fit: needs")
    assert "host memory" in message and message.endswith("placements that fit here: a.") and "\n" not in message
    with pytest.raises(TandemError, match=r"--offload c-q8_0 .*not allowed: KV quantization is off.*"
                                          r"placements that fit here: a, b\."):
        _plan(qwen7b, real_models.qwen_05b, machine, allow_kv_quant=False, offload="c-q8_0")
    with pytest.raises(TandemError, match="--offload c-q4_0 .*not compared: --kv-type fixes the KV cache type"):
        _plan(qwen7b, real_models.qwen_05b, machine, kv_type="f16", offload="c-q4_0")
    with pytest.raises(TandemError, match="--offload c-q8_0: that placement is not compared .* already q8_0"):
        _plan(qwen7b, real_models.qwen_05b, machine, kv_type="q8_0", offload="c-q8_0")


def test_a_pin_with_no_placements_to_choose_from_is_refused(qwen7b: Path, real_models) -> None:
    roomy = _machine(vram="12GiB", budget="12GiB")
    with pytest.raises(TandemError, match="--offload a picks among .* but the target fits the GPU budget whole"):
        _plan(qwen7b, real_models.qwen_05b, roomy, offload="a")
    no_gpu = resolve_machine(None, "12GiB", None, measure_bandwidth=False)
    no_gpu = replace(no_gpu, gpus=(), vram_budget=0)
    with pytest.raises(TandemError, match="--offload b picks among .* no GPU llama.cpp can offload to"):
        _plan(qwen7b, None, no_gpu, offload="b")
