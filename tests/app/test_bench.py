"""`tandem bench`: configurations built through build_strategy, paired ratios, peers, report.

The real-model runs generate a handful of tokens (SmolLM2-135M as target; the 0.5B for
the 151,936-token AR-overhead path): they check the report's structure, greedy identity
and that every ratio is the paired one, never a speed.
"""

from __future__ import annotations

import json
import statistics

import pytest

from tandem.app.bench.peers import RunResult
from tandem.app.bench.report import markdown_table, summarize
from tandem.app.bench.runner import Run, rotated, select, select_families
from tandem.app.cli import main
from tandem.errors import TandemError


def _result(tps: float, tokens: list[int], calls: int = 4, drafted: int = 0, accepted: int = 0) -> RunResult:
    return RunResult(tokens, tps, tps * 2, calls, drafted, accepted)


class _FakeTarget:
    """Just what summarize reads of a backend: token bytes and end-of-generation ids."""

    class special:
        eog = frozenset({0})

    @staticmethod
    def token_bytes(t: int) -> bytes:
        return f"<{t}>".encode()


def test_ratios_are_paired_with_the_plain_run_of_the_same_prompt_and_rep() -> None:
    runs = [
        Run("plain", "chat", 0, 0, _result(10.0, [1, 2, 3, 4])),
        Run("plain", "chat", 1, 0, _result(20.0, [5, 6, 0, 7])),
        Run("ngram", "chat", 0, 0, _result(15.0, [1, 2, 3, 4], calls=2, drafted=4, accepted=2)),
        Run("ngram", "chat", 1, 0, _result(18.0, [5, 6, 0, 8], calls=3, drafted=2, accepted=1)),
        Run("llama", "chat", 0, 0, _result(12.0, [1, 2, 3, 9])),
        Run("llama", "chat", 1, 0, _result(30.0, [5, 6, 0, 7])),
    ]
    table = summarize(runs, _FakeTarget(), ["plain", "ngram", "llama"])["workloads"]["chat"]
    ngram, llama = table["rows"]["ngram"], table["rows"]["llama"]
    # paired: 15/10 and 18/20, not (15+18)/(10+20) or a ratio of medians
    assert ngram["ratio"] == {"median": statistics.median([1.5, 0.9]), "min": 0.9, "max": 1.5}
    assert ngram["tokens_per_s"]["median"] == statistics.median([15.0, 18.0])
    assert ngram["tokens_per_call"] == 8 / 5 and ngram["acceptance"] == 3 / 6
    assert ngram["identical"] is False and ngram["kind"] == "tandem"
    assert llama["kind"] == "peer" and llama["ratio"]["max"] == 1.5 and llama["acceptance"] is None
    assert table["rows"]["plain"]["ratio"]["median"] == 1.0 and table["rows"]["plain"]["identical"]
    assert table["best_fixed"] == "plain" and set(table["adaptive_vs_best_fixed"]) == {"ngram"}
    assert [s["eog_at"] for s in table["plain_samples"]] == [None, 2]
    assert "differs" in markdown_table({"workloads": {"chat": table}})


def test_best_fixed_and_adaptive_share() -> None:
    runs = [Run("plain", "edit", 0, 0, _result(10.0, [1])), Run("model@4", "edit", 0, 0, _result(20.0, [1])),
            Run("auto+model", "edit", 0, 0, _result(19.0, [1]))]
    table = summarize(runs, _FakeTarget(), ["plain", "model@4", "auto+model"])["workloads"]["edit"]
    assert table["best_fixed"] == "model@4" and table["best_fixed_ratio"] == 2.0
    assert table["adaptive_vs_best_fixed"]["auto+model"] == pytest.approx(0.95)


def test_config_selection_and_rotation() -> None:
    names = ["plain", "ngram", "auto+model", "model@4", "llama"]
    assert select(names, ["model@4", "ngram"]) == ["plain", "ngram", "model@4"]
    assert select(names, None) == names
    with pytest.raises(TandemError, match="offers plain, ngram"):
        select(names, ["model@5"])
    assert select_families(names, ["model"]) == ["plain", "auto+model", "model@4", "llama"]
    assert rotated(names, 7) == names[2:] + names[:2]
    assert {tuple(rotated(names, s))[0] for s in range(len(names))} == set(names)


def test_bad_arguments_fail_before_any_model_is_loaded(tmp_path, capsys) -> None:
    missing = tmp_path / "nope.gguf"
    assert main(["bench", "-m", str(missing), "--workloads", "chat,poetry"]) != 0
    assert "Unknown workload 'poetry'" in capsys.readouterr().err
    assert main(["bench", "-m", str(missing), "--plot", str(tmp_path / "no" / "x.png")]) != 0
    assert "does not exist" in capsys.readouterr().err


def test_bench_toy_models_and_old_workloads(tinystories656k_gguf, tmp_path, monkeypatch) -> None:
    """The toy workloads still run, with the fixture model as its own oracle drafter.

    The toy's verify cost is given, not timed: its calls take ~0.1 ms, dominated by a
    first call at each new size, and a 6-token run's few timings could price every
    draft out (seen in CI) — this test is about the shared suffix tree, not the timing."""
    from tandem.runtime.speculative import factory
    from tandem.runtime.speculative.cost import CostCurve

    monkeypatch.setattr(factory, "cached_cost_curve", lambda *args, **kwargs: CostCurve.linear(0.1))
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = main(["bench", "-m", str(tinystories656k_gguf), "--oracle", str(tinystories656k_gguf), "-n", "6",
               "--prompts", "1", "--lengths", "2", "--workloads", "story,repetitive", "--threads", "1",
               "--ctx", "256", "--json", str(out), "--plot", str(png)])
    assert rc == 0 and png.stat().st_size > 0
    report = json.loads(out.read_text())
    assert set(report["workloads"]) == {"story", "repetitive"}
    for table in report["workloads"].values():
        assert set(table["rows"]) == {"plain", "ngram", "auto+oracle", "oracle@2", "llama", "llama-lookup"}
        assert all(row["identical"] for row in table["rows"].values() if row["kind"] == "tandem")
    # the re-asked story drafts from the earlier request in the shared suffix tree
    assert report["workloads"]["repetitive"]["rows"]["ngram"]["tokens_per_call"] > 1.0


def test_bench_real_chat_model_report(real_models, tmp_path, capsys) -> None:
    """SmolLM2 target through its chat template: same-vocab drafter (itself), a
    cross-vocabulary drafter (the Qwen 0.5B) and both llama-cpp-python peers."""
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = main(["bench", "-m", str(real_models.smollm2), "--draft", str(real_models.smollm2),
               "--draft2", str(real_models.qwen_05b), "-n", "8", "--reps", "1", "--prompts", "1",
               "--workloads", "chat", "--lengths", "3", "--threads", "1", "--ctx", "512",
               "--json", str(out), "--plot", str(png)])
    assert rc == 0 and png.stat().st_size > 0
    report = json.loads(out.read_text())
    assert report["config"]["drafters"]["model"]["same_vocab"] is True
    assert report["config"]["drafters"]["xvocab"]["same_vocab"] is False
    assert "exact=True" in report["config"]["tandem_backend"] and "repacked" in report["config"]["peers"]
    table = report["workloads"]["chat"]
    rows = table["rows"]
    assert set(rows) == {"plain", "ngram", "auto+model", "model@3", "auto+xvocab", "xvocab@3", "llama", "llama-lookup"}
    by_config = {r["config"]: r for r in report["runs"] if r["workload"] == "chat"}
    plain_tps = by_config["plain"]["tokens_per_s"]
    for name, row in rows.items():
        assert row["runs"] == 1 and row["tokens_per_s"]["median"] > 0
        assert row["ratio"]["median"] == pytest.approx(by_config[name]["tokens_per_s"] / plain_tps)
        assert row["tokens_per_call"] >= 1.0 or row["kind"] == "peer"
        if row["kind"] == "tandem":
            assert row["identical"], name
    assert rows["model@3"]["acceptance"] is not None and rows["model@3"]["tokens_per_call"] > 1.0
    assert table["plain_samples"][0]["text"].strip()  # the model answered the rendered chat prompt
    printed = capsys.readouterr().out
    assert "| chat |" in printed and "llama-lookup" in printed


def test_ar_overhead_on_a_151936_token_vocabulary(real_models, tmp_path) -> None:
    """Tandem's plain loop vs llama.cpp's C-API loop on the same kernels: identical
    tokens, and the per-token overhead is the difference of the two rates."""
    from tandem.app.bench.ar_overhead import measure_overhead

    res = measure_overhead(real_models.qwen_05b, tokens=6, rounds=1, threads=1, prompts=1, n_ctx=256)
    assert res.n_vocab == 151936 and res.identical
    assert res.tandem_tps > 0 and res.native_tps > 0 and res.llama_tps > 0 and res.native_eval_ms_per_token > 0
    assert res.tandem_ms_per_token == pytest.approx(1e3 / res.tandem_tps)
    assert res.native_ratio > 0 and res.ratio > 0


def test_cost_curve_exact_and_fast_and_drafter_cost(stories260k, tmp_path) -> None:
    out = tmp_path / "cost.json"
    rc = main(["bench", "--cost-curve", "-m", str(stories260k), "--draft", str(stories260k), "--reps", "2",
               "--draft-max", "4", "--threads", "1", "--ctx", "256", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert set(res["curves"]) == {"exact", "fast"}
    for curve in res["curves"].values():
        assert len(curve) == 5 and curve[0] == 1.0 and min(curve) > 0
    assert res["t1_ms"]["exact"] > 0 and res["drafter_cost"]["stories260K"] > 0


def test_plain_and_model_free_run_on_the_first_drafters_engine(real_models) -> None:
    """``plain``, ``ngram`` and ``auto+model`` decode on one loaded target (only the draft
    mode differs), so their ratios compare strategies, not two copies of the weights."""
    from pathlib import Path

    from tandem.app.bench.runner import BenchConfig, engines_in, open_configs
    from tandem.runtime.engine.spec import EngineSpec

    cfg = BenchConfig(Path(real_models.smollm2), draft=Path(real_models.smollm2), draft2=Path(real_models.qwen_05b),
                      threads=1, ctx=512, lengths=())
    spec = EngineSpec(cfg.target, draft_mode="off", threads=1, n_ctx=512, engine="llama.cpp")
    engines, drafters = open_configs(spec, cfg, lambda _: None)
    try:
        assert list(engines)[:2] == ["plain", "ngram"]
        assert engines["plain"] is engines["ngram"] is engines["auto+model"]
        assert engines["auto+xvocab"] is not engines["plain"]
        assert len(engines_in(engines)) == 2 and [d.label for d in drafters] == ["model", "xvocab"]
    finally:
        for engine in engines_in(engines):
            engine.close()
