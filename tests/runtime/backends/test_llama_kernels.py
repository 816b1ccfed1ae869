"""llama.cpp's configuration chosen per machine and model: measured once (both lossless
configurations timed in turn), cached, used by the engine and reported by `--json`."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.backends import llama_kernels
from tandem.runtime.backends.llama_config import EXACT_BATCH, EXACT_BATCH_REPACKED
from tandem.runtime.backends.llama_kernels import (
    DECODE_TIE,
    KernelChoice,
    cached_choice,
    choose_kernels,
    decide,
    probe,
    remember,
)
from tandem.runtime.engine.builder import open_engine
from tandem.runtime.engine.spec import EngineSpec
from tandem.runtime.generate import DoneEvent, generate


def test_repacked_unless_the_weights_as_stored_are_not_slower_at_either() -> None:
    fast, slow = {"decode_s": 0.05, "prompt_s": 0.02}, {"decode_s": 0.07, "prompt_s": 0.03}
    assert decide(exact=slow, repacked=fast, threads=2).repack  # faster at both
    assert not decide(exact=fast, repacked=slow, threads=2).repack  # slower at both
    mixed = {"decode_s": 0.05, "prompt_s": 0.03}
    assert decide(exact=mixed, repacked={"decode_s": 0.07, "prompt_s": 0.02}, threads=2).repack  # faster prompts
    assert decide(exact=mixed, repacked={"decode_s": 0.04, "prompt_s": 0.04}, threads=2).repack  # faster decoding
    tie = decide(exact=fast, repacked=dict(fast), threads=2)
    assert not tie.repack and "1.00x" in tie.why  # equal: the longer verify calls win


def test_decoding_within_the_tie_is_equal_and_prompts_decide() -> None:
    """A few decode steps cannot rank two configurations that read the same weights closer
    than a few percent; where the weights as stored process prompts faster (an AVX2-only
    EPYC: 1.19x on long prompts), a repacked decode 2 % faster is not worth losing that."""
    exact = {"decode_s": 0.0816, "prompt_s": 0.025}
    slightly = decide(exact=exact, repacked={"decode_s": 0.080, "prompt_s": 0.030}, threads=2)
    assert not slightly.repack and "equal decoding" in slightly.why and "1.02x" in slightly.why
    clearly = decide(exact=exact, repacked={"decode_s": 0.0816 / (1 + DECODE_TIE + 0.01), "prompt_s": 0.030},
                     threads=2)
    assert clearly.repack  # beyond the tie, faster decoding wins
    assert decide(exact=exact, repacked={"decode_s": 0.080, "prompt_s": 0.024}, threads=2).repack  # and faster prompts


def test_the_probe_loads_each_configuration_in_turn_and_takes_medians(monkeypatch) -> None:
    """exact, repacked, repacked, exact: a machine slowing down (a laptop's clock, another
    program) weighs on both alike, where timing one configuration after the other gave
    the later one the whole drift."""
    loads: list[bool] = []

    def timed(model, threads, repack, prompt_tokens, steps):
        loads.append(repack)
        drift = 1 + 0.1 * len(loads)  # every load slower than the last
        return 0.02 * drift, 0.08 * drift  # the same speed in truth

    monkeypatch.setattr(llama_kernels, "_time_once", timed)
    choice = probe("m.gguf", 2, rounds=2)
    assert loads == [False, True, True, False]
    assert not choice.repack and choice.measured["exact"] == choice.measured["repacked"]


def test_a_probe_timed_beside_other_work_is_not_kept() -> None:
    """Decoding reads every weight once a token either way: one configuration decoding 3x
    slower than the other was timed while something else held the cores (a cached probe
    read "0.00x"). Prompts may differ more (batched kernels)."""
    sane = {"decode_s": 0.016, "prompt_s": 0.005}
    contended = {"decode_s": 3.4, "prompt_s": 0.054}
    assert llama_kernels.plausible(decide(exact=sane, repacked={"decode_s": 0.015, "prompt_s": 0.0052}, threads=2))
    assert llama_kernels.plausible(decide(exact=sane, repacked={"decode_s": 0.012, "prompt_s": 0.001}, threads=2))
    assert not llama_kernels.plausible(decide(exact=sane, repacked=contended, threads=2))
    assert not llama_kernels.plausible(decide(exact=contended, repacked=sane, threads=2))
    assert not llama_kernels.plausible(KernelChoice(False, "nothing measured", 2))


def test_the_background_probe_keeps_only_a_plausible_choice(stories260k: Path, tmp_path: Path, monkeypatch) -> None:
    model = tmp_path / "m.gguf"
    shutil.copy(stories260k, model)
    monkeypatch.setattr(llama_kernels.os, "nice", lambda n: 0)  # the test process stays as it is
    sane = {"decode_s": 0.016, "prompt_s": 0.005}
    for repacked, kept in (({"decode_s": 3.4, "prompt_s": 0.054}, False), ({"decode_s": 0.015, "prompt_s": 0.004}, True)):
        monkeypatch.setattr(llama_kernels, "probe", lambda m, t, r=repacked: decide(sane, r, t))
        assert llama_kernels._child(str(model), 1) == (0 if kept else 1)
        assert (cached_choice(model, 1) is not None) == kept


def test_probe_measures_both_and_the_choice_is_cached(stories260k: Path, tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    shutil.copy(stories260k, model)
    pending = choose_kernels(model, 1)
    assert pending.pending and not pending.repack and cached_choice(model, 1) is None
    choice = probe(model, 1, rounds=1, prompt_tokens=16, steps=2)
    assert set(choice.measured) == {"exact", "repacked"}
    assert all(v["decode_s"] > 0 and v["prompt_s"] > 0 for v in choice.measured.values())
    remember(model, 1, choice)
    again = choose_kernels(model, 1)
    assert again == KernelChoice(choice.repack, choice.why, 1, choice.measured) and not again.pending
    assert cached_choice(model, 2) is None  # per thread count


def test_measure_later_is_off_in_tests_and_once_at_a_time(stories260k: Path, monkeypatch) -> None:
    assert not llama_kernels.measure_later(stories260k, 1)  # TANDEM_KERNEL_PROBE=off (conftest)
    started: list[list[str]] = []
    monkeypatch.setenv("TANDEM_KERNEL_PROBE", "on")
    monkeypatch.setattr(llama_kernels.subprocess, "Popen", lambda cmd, **kw: started.append(cmd))
    assert llama_kernels.measure_later(stories260k, 1)
    assert not llama_kernels.measure_later(stories260k, 1)  # one probe at a time
    assert len(started) == 1 and started[0][-2:] == [str(stories260k), "1"]


@pytest.mark.parametrize("repack", [False, True])
def test_engine_uses_the_cached_choice_and_stays_lossless(real_models, repack: bool) -> None:
    """With the choice cached (either way), the engine opens that configuration, says so
    in ``describe()`` (``tandem run --json``), and greedy speculative output is the
    target's own greedy output. The drafts are of a fixed length: whether the adaptive
    policy drafts at all depends on this CPU's verify costs (on a 2-vCPU Zen 5, repacked,
    it rightly drafted nothing), and verification in the configuration's chunks is what
    is tested."""
    model = real_models.qwen_05b
    remember(model, 2, KernelChoice(repack, "measured here: test", 2, {}))
    prompt_text = "Rename the variable `count` to `total` in:\n\ndef f(xs):\n    count = 0\n" \
                  "    for x in xs:\n        count += x\n    return count\n"
    outputs = {}
    for mode in ("off", "ngram"):
        with open_engine(EngineSpec(model, draft_mode=mode, draft_len=8, threads=2, n_ctx=512)) as engine:
            assert engine.target.exact_batch == (EXACT_BATCH_REPACKED if repack else EXACT_BATCH)
            kernels = engine.describe()["kernels"]
            assert kernels["config"] == ("repacked" if repack else "exact") and kernels["why"].startswith("measured")
            ids = engine.target.tokenize(prompt_text)
            done = [e for e in generate(engine.target, ids, Sampler(SamplingParams(temperature=0.0)),
                                        strategy=engine.strategy, max_tokens=48) if isinstance(e, DoneEvent)][0]
            outputs[mode] = (done.tokens, done.stats.tokens_per_call)
    assert outputs["ngram"][0] == outputs["off"][0]
    assert outputs["ngram"][1] > 1.0  # it did speculate


def test_an_explicit_flag_wins_over_the_machine(stories260k: Path) -> None:
    remember(stories260k, 1, KernelChoice(True, "measured here: test", 1, {}))
    with open_engine(EngineSpec(stories260k, repack=False, threads=1, draft_mode="off")) as engine:
        assert engine.target.exact_batch == EXACT_BATCH and "kernels" not in engine.describe()
    with open_engine(EngineSpec(stories260k, threads=1, draft_mode="off")) as engine:
        assert engine.target.exact_batch == EXACT_BATCH_REPACKED
