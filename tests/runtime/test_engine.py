"""The one engine builder: each model opened once, the same greedy output in every mode,
the torch engine's KV compression and expert offload reachable and priced, --kv-type."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tandem.errors import BudgetError, TandemError
from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.engine.builder import Engine, open_engine
from tandem.runtime.engine.spec import EngineSpec
from tandem.runtime.generate import DoneEvent, generate
from tandem.runtime.kv.config import PRESETS, held_bytes
from tandem.runtime.moe.config import MoeOffloadSpec

PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play"


def greedy(engine: Engine, n: int = 24) -> list[int]:
    ids = engine.target.tokenize(PROMPT, add_bos=True)
    done = [e for e in generate(engine.target, ids, Sampler(SamplingParams.greedy_params()),
                                strategy=engine.strategy, max_tokens=n, stop_at_eog=False)
            if isinstance(e, DoneEvent)]
    return done[0].tokens


def tandem_json(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "tandem.app.cli", "run", "--json", "-p", PROMPT, *args],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_each_model_is_opened_once_and_output_is_plain_greedy(stories_twin: Path, stories260k: Path,
                                                               isolated_home: Path, monkeypatch) -> None:
    """With two placement options the calibration measures the drafter; the engine then
    generates with that very backend (no second load), token-identical to plain decoding."""
    import tandem.runtime.planning.placement as placement
    from tandem.runtime.backends.llama import LlamaCppBackend

    monkeypatch.setattr(placement, "MIN_SPLIT_THREADS", 2)  # a 2-core box has one option otherwise
    opened: list[str] = []
    init = LlamaCppBackend.__init__

    def counting(self, path, config=None, **kwargs) -> None:
        opened.append(Path(path).name)
        init(self, path, config, **kwargs)

    monkeypatch.setattr(LlamaCppBackend, "__init__", counting)
    spec = EngineSpec(stories_twin, stories260k, draft_mode="model", threads=2, n_ctx=512)
    stages: list[str] = []
    with open_engine(spec, notify=stages.append) as engine:
        assert engine.placement is not None and not engine.placement.cached  # measured: two options
        assert engine.drafter_backend is not None
        assert sorted(opened) == sorted([stories_twin.name, stories260k.name])  # each exactly once
        assert engine.strategy.describe()["drafter"] == f"model:{stories260k.stem}"
        speculative = greedy(engine)
    assert "planning memory" in stages and "placing the drafter (measured on a pair's first run)" in stages
    with open_engine(replace(spec, draft_mode="off")) as plain:
        assert plain.strategy.describe()["policy"] == "off"
        assert greedy(plain) == speculative


def test_default_mode_is_auto_with_model_free_drafting(stories260k: Path) -> None:
    with open_engine(EngineSpec(stories260k, threads=1, n_ctx=256)) as engine:
        info = engine.describe()
        assert info["speculation"]["drafter"] == "suffix+lookup" and info["kv_type"] == "f16"
        auto = greedy(engine)
    with open_engine(EngineSpec(stories260k, threads=1, n_ctx=256, draft_mode="off")) as plain:
        assert greedy(plain) == auto


def test_settings_that_cannot_apply_are_refused_before_loading(stories260k: Path) -> None:
    with pytest.raises(TandemError, match="needs a drafter"):
        open_engine(EngineSpec(stories260k, draft_mode="model"))
    with pytest.raises(TandemError, match="--engine torch"):
        open_engine(EngineSpec(stories260k, kv_compress=PRESETS["kivi4"].config))
    with pytest.raises(TandemError, match="--kv-compress"):
        open_engine(EngineSpec(stories260k, engine="torch", kv_type="q8_0"))
    with pytest.raises(TandemError, match="blocks of 32"):  # stories260K's heads are 8 wide
        open_engine(EngineSpec(stories260k, kv_type="q8_0"))


@pytest.mark.parametrize("preset", ["rotatekv", "cake+kivi4"])
def test_torch_engine_kv_compression_end_to_end(stories260k: Path, preset: str) -> None:
    """``--engine torch --kv-compress``: the compressed cache is in place, holds no more than
    the planner priced, and speculative output equals plain output on it."""
    from tandem.runtime.kv.compress import CompressedKVCache

    spec = EngineSpec(stories260k, engine="torch", device="cpu", threads=1, n_ctx=256,
                      kv_compress=PRESETS[preset].config)
    with open_engine(spec) as engine:
        cache = engine.target.cache
        assert isinstance(cache, CompressedKVCache) and engine.kind == "torch"
        assert any("KV compression" in n for n in engine.notes)  # the measured quality cost is said
        speculative = greedy(engine, 48)
        cfg = engine.target.model_config
        priced = held_bytes(spec.kv_compress, n_layer=cfg.n_layer, n_head_kv=cfg.n_head_kv,
                            head_dim=cfg.head_dim, n_tokens=len(engine.target.tokens), pass_tokens=256)
        assert 0 < cache.nbytes() <= priced
        assert engine.describe()["kv_compress"] == preset
    with open_engine(replace(spec, draft_mode="off")) as plain:
        assert greedy(plain, 48) == speculative


def test_torch_engine_moe_offload_end_to_end(stories_moe: Path) -> None:
    """``--moe-offload 25%``: experts behind a cache of a quarter of their bytes, lossless."""
    from tandem.runtime.moe.expert_cache import OffloadedExperts, moe_layers
    from tandem.runtime.planning.torch_target import plan_torch

    spec = EngineSpec(stories_moe, engine="torch", device="cpu", threads=1, n_ctx=256, draft_mode="off")
    with open_engine(spec) as dense:
        reference = greedy(dense, 16)
    with open_engine(replace(spec, moe_offload=MoeOffloadSpec("25%"))) as engine:
        assert all(isinstance(f.store, OffloadedExperts) for f in moe_layers(engine.target))
        manager = engine.extras[0]
        plan = engine.torch_plan
        assert plan is not None and manager.cfg.budget_bytes == plan.expert_bytes // 4
        assert greedy(engine, 16) == reference
        assert manager.cache.used <= manager.cfg.budget_bytes and manager.stats.misses > 0
        assert any("lossless" in n for n in engine.notes)
        dense_plan = plan_torch(stories_moe, ctx=256, device="cpu", check=False)
        assert dense_plan.load_peak - plan.load_peak >= 0.9 * plan.expert_bytes  # loading never holds them


def test_lazy_experts_stay_in_the_file_until_offloaded(stories_moe: Path) -> None:
    from tandem.runtime.backends.torch_engine.backend import TorchBackend, TorchConfig
    from tandem.runtime.moe.expert_cache import moe_layers

    with TorchBackend(stories_moe, TorchConfig(device="cpu", n_threads=1)) as dense, \
            TorchBackend(stories_moe, TorchConfig(device="cpu", n_threads=1, lazy_experts=True)) as lazy:
        assert all(f.store.gate.numel() == 0 for f in moe_layers(lazy))
        assert all(f.store.gate.numel() > 0 for f in moe_layers(dense))
        assert lazy.model.weight_bytes() < dense.model.weight_bytes()


def test_torch_engine_refuses_a_budget_it_cannot_fit(stories260k: Path) -> None:
    with pytest.raises(BudgetError, match="--kv-compress"):
        open_engine(EngineSpec(stories260k, engine="torch", device="cpu", budget="50MiB"))


def test_cli_run_reaches_the_torch_techniques(stories260k: Path, stories_moe: Path) -> None:
    out = tandem_json("-m", str(stories260k), "-n", "8", "--engine", "torch", "--device", "cpu",
                      "--kv-compress", "kivi4", "--threads", "1")
    assert out["engine"]["engine"] == "torch" and out["engine"]["kv_compress"] == "kivi4"
    assert out["stats"]["generated_tokens"] == 8
    out = tandem_json("-m", str(stories_moe), "-n", "8", "--engine", "torch", "--device", "cpu",
                      "--moe-offload", "50%", "--threads", "1")
    assert out["engine"]["moe_offload"] == "50% lru"


def test_kv_type_on_a_real_model(real_models) -> None:
    """``--kv-type q8_0`` on Qwen2.5-Coder 0.5B: planned and opened with it; the planner
    picks a quantized KV itself when f16 does not fit the budget, and says so."""
    out = tandem_json("-m", str(real_models.qwen_05b), "-n", "8", "--threads", "1", "--ctx", "1024",
                      "--kv-type", "q8_0", "--raw")
    assert out["engine"]["kv_type"] == "q8_0" and out["stats"]["generated_tokens"] == 8
    from tandem.runtime.planning.hardware import resolve_machine
    from tandem.runtime.planning.plan import PlanRequest
    from tandem.runtime.planning.planner import make_plan

    def plan(budget: int | None, kv_type: str | None = None):
        machine = resolve_machine(None, budget, None, measure_bandwidth=False)
        return make_plan(PlanRequest(real_models.qwen_05b, None, 4096, machine, threads=1, kv_type=kv_type,
                                     baseline=100 * 2**20))

    from tandem.runtime.planning.devices import SAFETY
    from tandem.runtime.planning.shapes import shape_from_gguf
    from tandem.runtime.planning.suggest import lean_need

    roomy = plan(None)
    assert roomy.fits and roomy.target.type_k == "f16" and roomy.kv_note is None
    # Between what the leanest f16 rung and the leanest q8_0 rung need: only a quantized KV fits.
    shape = shape_from_gguf(real_models.qwen_05b)
    need = (lean_need(shape, 4096, "f16", 8) + lean_need(shape, 4096, "q8_0", 8)) // 2
    budget = int((100 * 2**20 + need) / (1 - SAFETY))
    tight = plan(budget)
    assert tight.fits and tight.target.type_k in ("q8_0", "q4_0")
    assert tight.kv_note and "f16 did not fit" in tight.kv_note and tight.kv_note in tight.reasons
    assert not plan(budget, kv_type="f16").fits  # asked for f16: the plan says it does not fit


LEFTOVER_THREADS = """
import os, sys, time
from pathlib import Path
from tandem.runtime.engine.builder import open_engine
from tandem.runtime.engine.spec import EngineSpec

before = len(os.listdir("/proc/self/task"))
engine = open_engine(EngineSpec(Path(sys.argv[1]), threads=2, n_ctx=512))
deadline = time.monotonic() + 30
while len(os.listdir("/proc/self/task")) > before and time.monotonic() < deadline:
    time.sleep(0.05)  # a passing thread's OpenMP team exits just after it
print(before, len(os.listdir("/proc/self/task")))
engine.close()
"""


def test_opening_an_engine_leaves_no_openmp_team_behind(real_models) -> None:
    """Opening computes (the verify-cost measurement). If that ran on the caller's thread,
    llama.cpp's OpenMP team would stay alive there beside the one of the thread that later
    generates (a server's worker): more OpenMP threads than cores, and libgomp then sleeps
    at every barrier (~100 context switches a token, 25 % slower). A fresh process opens
    SmolLM2 with two threads; afterwards it has no more threads than before."""
    out = subprocess.run([sys.executable, "-c", LEFTOVER_THREADS, str(real_models.smollm2)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    before, after = map(int, out.stdout.split())
    assert after == before, f"{after - before} thread(s) left running after open_engine"


@pytest.mark.parametrize("mode,priced", [("ngram", True), ("auto", True), ("off", False)])
def test_model_free_drafting_is_priced_whenever_the_mode_uses_it(stories_twin: Path, mode: str,
                                                                 priced: bool) -> None:
    """``--draft-mode ngram`` (or ``auto``) without a drafter model still runs the suffix
    tree and prompt lookup over the whole context: the plan the engine opened with prices
    their index; plain decoding has none."""
    with open_engine(EngineSpec(stories_twin, draft_mode=mode, n_ctx=512, threads=1, measure_cost=False)) as engine:
        assert engine.plan is not None
        rows = [i for i in engine.plan.memory.items if i.label.startswith("model-free drafting index")]
    assert bool(rows) is priced and all(r.bytes > 0 for r in rows)
