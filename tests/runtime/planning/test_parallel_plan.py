"""The memory plan of parallel slots: each slot's KV priced, ``tandem serve``'s default
``--parallel`` chosen from what fits."""

from __future__ import annotations

from pathlib import Path

from tandem.runtime.planning.devices import SAFETY
from tandem.runtime.planning.hardware import resolve_machine
from tandem.runtime.planning.plan import PlanRequest
from tandem.runtime.planning.planner import make_plan, parallel_for
from tandem.runtime.planning.shapes import padded_ctx

MiB = 2**20


def _kv_bytes(plan) -> int:
    return sum(item.bytes for item in plan.memory.items if "KV cache" in item.label)


def test_each_slot_is_priced_its_own_kv(real_models) -> None:
    machine = resolve_machine(budget="16GiB", measure_bandwidth=False)
    one = make_plan(PlanRequest(real_models.qwen_05b, None, 1024, machine, baseline=40 * MiB, model_free=False))
    three = make_plan(PlanRequest(real_models.qwen_05b, None, 1024, machine, baseline=40 * MiB, model_free=False,
                                  n_seq=3))
    assert one.fits and three.fits
    assert three.target.n_ctx == one.target.n_ctx  # the context is per slot
    # llama.cpp pads the whole context (all slots' cells) to its cell granularity, then
    # splits it into one stream per slot: priced as that one padded context
    per_token = _kv_bytes(one) // padded_ctx(one.target.n_ctx)
    assert per_token > 0
    assert _kv_bytes(three) == per_token * padded_ctx(3 * one.target.n_ctx) >= 3 * per_token * one.target.n_ctx
    assert three.memory.host - one.memory.host >= 2 * _kv_bytes(one)
    # each slot drafts from its own model-free index
    machine_free = [make_plan(PlanRequest(real_models.qwen_05b, None, 1024, machine, baseline=40 * MiB,
                                          model_free=True, n_seq=n)) for n in (1, 3)]
    index = [sum(i.bytes for i in p.memory.items if "model-free" in i.label) for p in machine_free]
    assert index[1] == 3 * index[0] > 0
    config = three.target.llama_config()
    assert config.n_seq == 3 and config.n_ctx == one.target.n_ctx


def test_default_parallel_is_what_the_budget_fits(real_models) -> None:
    target: Path = real_models.qwen_05b
    assert parallel_for(target, "16GiB", 4096) == 4
    machine = resolve_machine(budget="16GiB", measure_bandwidth=False)
    one = make_plan(PlanRequest(target, None, 4096, machine, model_free=True))
    two = make_plan(PlanRequest(target, None, 4096, machine, model_free=True, n_seq=2))
    # a budget between one slot's plan and two slots' (half a slot's KV either side): one
    # slot, at the full context and f16 KV, rather than two at less
    between = one.host_total + (two.host_total - one.host_total) // 2
    budget = int(between / (1 - SAFETY))
    assert parallel_for(target, budget, 4096) == 1
    assert parallel_for(target, int((two.host_total + 16 * MiB) / (1 - SAFETY)), 4096) == 2
