"""`tandem bench --gpu` and `--record-acceptance`: the GPU comparisons in one run, and
acceptance recorded with real models priced on a device's cost curve.

The --gpu mode runs on the CPU where llama.cpp lists no GPU, so every section is checked
here on SmolLM2-135M (as its own drafter, a handful of tokens); the pricing is checked
against a hand computation on a tiny trace. No figure here is a speed claim.
"""

from __future__ import annotations

import json

import pytest

from tandem.app.bench.acceptance_traces import (
    call_cost,
    is_model_source,
    load,
    modeled_speedup,
    price,
)
from tandem.app.cli import main
from tandem.errors import TandemError

CURVE = [1.0, 1.1, 1.2, 1.3, 1.5]
"""c(1..5) of a made-up device."""


def test_plain_is_one_and_a_trace_is_priced_as_by_hand() -> None:
    plain = [[[0, 0, 1, 0]] * 7]
    assert modeled_speedup(plain, CURVE, 0.5) == 1.0
    # a model-drafted round of 2 (both accepted), one of 4 (1 accepted), a model-free
    # round of 3 (2 accepted, free to draft), a timing round padded to 5 with no drafts
    trace = [[[2, 2, 3, 1], [4, 1, 5, 1], [3, 2, 4, 0], [0, 0, 5, 0]]]
    tokens = 3 + 2 + 3 + 1
    cost = (1.2 + 0.5 * 2) + (1.5 + 0.5 * 4) + 1.3 + 1.5
    assert modeled_speedup(trace, CURVE, 0.5) == pytest.approx(tokens / cost)


def test_the_curve_continues_past_its_last_point() -> None:
    assert call_cost(CURVE, 1) == 1.0 and call_cost(CURVE, 5) == 1.5
    assert call_cost(CURVE, 7) == pytest.approx(1.5 + 2 * 0.2)


def test_model_sources_are_told_from_model_free_ones() -> None:
    assert not is_model_source("suffix") and not is_model_source("lookup+suffix")
    assert is_model_source("model:qwen.gguf") and is_model_source("suffix+model:qwen.gguf")


def test_price_leaves_out_model_configs_without_a_drafter_cost() -> None:
    record = {"workloads": {"edit": {"plain": {"rounds": [[[0, 0, 1, 0]] * 4], "mismatches": 0},
                                     "model@2": {"rounds": [[[2, 2, 3, 1], [2, 0, 3, 1]]], "mismatches": 0}}}}
    assert set(price(record, CURVE, None)["edit"]) == {"plain"}
    rows = price(record, CURVE, 0.25)["edit"]
    assert rows["plain"]["modeled_speedup"] == 1.0 and rows["plain"]["acceptance"] is None
    assert rows["model@2"]["modeled_speedup"] == pytest.approx(4 / (2 * (1.2 + 0.5)), abs=1e-3)
    assert rows["model@2"]["acceptance"] == 0.5 and rows["model@2"]["tokens_per_call"] == 2.0


def test_load_refuses_what_is_not_a_record(tmp_path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{\"workloads\": {}}")
    with pytest.raises(TandemError, match="not an acceptance record"):
        load(bad)
    bad.write_text("not json")
    with pytest.raises(TandemError, match="not JSON"):
        load(bad)
    with pytest.raises(TandemError, match="Cannot read"):
        load(tmp_path / "missing.json")


def test_acceptance_needs_gpu(tmp_path, capsys) -> None:
    rc = main(["bench", "-m", str(tmp_path / "x.gguf"), "--acceptance", str(tmp_path / "a.json")])
    assert rc != 0 and "--acceptance goes with --gpu" in capsys.readouterr().err


@pytest.fixture(scope="module")
def recorded(real_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("acc") / "acceptance.json"
    rc = main(["bench", "--record-acceptance", str(out), "-m", str(real_models.smollm2), "--draft",
               str(real_models.smollm2), "-n", "10", "--prompts", "1", "--workloads", "edit,extract",
               "--lengths", "4", "--threads", "1", "--ctx", "768"])
    assert rc == 0
    return out


def test_recorded_acceptance_round_trips_and_prices(recorded) -> None:
    record = load(recorded)
    assert recorded.stat().st_size < 100_000
    assert record["drafters"] == {"model": "smollm2-135m-instruct.gguf"} and record["n_tokens"] == 10
    for table in record["workloads"].values():
        assert set(table) == {"plain", "ngram", "auto+model", "model@4", "ngram@4"}
        for name, entry in table.items():
            assert entry["mismatches"] == 0, name  # greedy speculative output is plain output on the CPU
            (rounds,) = entry["rounds"]
            assert sum(a + 1 for _, a, _, _ in rounds) >= 10
            assert all(0 <= a <= d and e >= d + 1 for d, a, e, _ in rounds)
        assert all(m == 1 for d, _, _, m in table["model@4"]["rounds"][0] if d)
        assert all(m == 0 for name in ("ngram", "ngram@4") for _, _, _, m in table[name]["rounds"][0])
        assert all(d <= 4 for d, _, _, _ in table["ngram@4"]["rounds"][0])
        assert table["model@4"]["rounds"][0][0][0] == 4  # its own drafter: every draft is whole
    rows = price(record, CURVE, 0.2)
    for wl, table in rows.items():
        assert table["plain"]["modeled_speedup"] == 1.0
        assert table["model@4"]["modeled_speedup"] == pytest.approx(
            modeled_speedup(record["workloads"][wl]["model@4"]["rounds"], CURVE, 0.2), abs=1e-3)
    assert json.loads(recorded.read_text()) == record


def test_gpu_mode_on_the_cpu_prints_every_section(real_models, recorded, tmp_path, capsys) -> None:
    out = tmp_path / "gpu.json"
    args = ["bench", "--gpu", "-m", str(real_models.smollm2), "--draft", str(real_models.smollm2), "-n", "8",
            "--reps", "1", "--prompts", "1", "--threads", "1", "--ctx", "768", "--acceptance", str(recorded),
            "--json", str(out)]
    try:
        import matplotlib  # noqa: F401
        png = tmp_path / "gpu.png"
        args += ["--plot", str(png)]
    except ImportError:
        png = None
    assert main(args) == 0
    printed = capsys.readouterr().out
    for section in ("[1] plain decoding", "[2] verify cost", "[3] end to end", "[4] modeled speedup"):
        assert section in printed
    res = json.loads(out.read_text())
    assert res["device"].startswith("CPU") and res["plain"]["n_gpu_layers"] == 0
    plain = res["plain"]
    for key in ("decode_tok_s", "prefill_tok_s"):
        assert plain[key]["tandem"]["median"] > 0 and plain[key]["llama"]["median"] > 0
    assert plain["ratio"]["decode"]["median"] == pytest.approx(
        plain["decode_tok_s"]["tandem"]["median"] / plain["decode_tok_s"]["llama"]["median"])
    assert 400 <= plain["prompt_tokens"] <= 500
    curve = res["cost"]["curves"]["exact"]
    (drafter_cost,) = res["cost"]["drafter_cost"].values()
    assert len(curve) == 16 and curve[0] == 1.0 and drafter_cost > 0
    assert set(res["end_to_end"]) == {"edit", "extract"}
    for rows in res["end_to_end"].values():
        assert {"plain", "ngram", "auto+model", "model@4", "model@8"} <= set(rows)
        assert all(row["mismatches"] == 0 for row in rows.values())  # the CPU: identical
    modeled = res["modeled"]["workloads"]
    assert "modeled" in res["modeled"]["note"]
    for wl, rows in modeled.items():
        assert rows["plain"]["modeled_speedup"] == 1.0
        assert rows["model@4"]["modeled_speedup"] == pytest.approx(
            modeled_speedup(load(recorded)["workloads"][wl]["model@4"]["rounds"], curve, drafter_cost), abs=1e-3)
    if png is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_failing_section_leaves_one_line_and_the_others_run(tmp_path) -> None:
    from tandem.app.bench.gpu import GpuBenchConfig, format_gpu, run_gpu_bench

    bogus = tmp_path / "broken.gguf"
    bogus.write_bytes(b"GGUF" + b"\0" * 60)
    lines: list[str] = []
    res = run_gpu_bench(GpuBenchConfig(bogus, acceptance={"workloads": {}}, reps=1, log=lines.append))
    for key in ("plain", "cost", "end_to_end"):
        assert "\n" not in res[key]["error"] and res[key]["error"], key
    assert "section 2 failed" in res["modeled"]["error"]
    text = format_gpu(res)
    assert text.count("failed:") == 4 and "Traceback" not in text
    assert any(line.startswith("4/4") for line in lines)
