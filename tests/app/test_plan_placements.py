"""`tandem plan` for a target bigger than the GPU budget: the placements it compared, in
text and in ``--json``, each with its memory and predicted speed, the winner marked and
why. Qwen2.5-7B shapes (a header, no weights) with the real 0.5B drafter, planned for a
profile's GPU at 3 GiB."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from real_shapes import qwen7b_header

from tandem.app.cli import main


@pytest.fixture(scope="module")
def qwen7b(real_models, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return qwen7b_header(tmp_path_factory.mktemp("shapes"), real_models.qwen_05b)


def _args(qwen7b: Path, real_models, *extra: str) -> list[str]:
    return ["plan", "-m", str(qwen7b), "--draft", str(real_models.qwen_05b), "--profile", "rtx3060-laptop",
            "--vram", "3GiB", *extra]


def test_plan_json_carries_every_placement(qwen7b: Path, real_models, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_args(qwen7b, real_models, "--json")) == 0
    out = json.loads(capsys.readouterr().out)
    options = out["placements"]
    assert [(o["key"], o["type_k"]) for o in options] == [("a", "f16"), ("b", "f16"), ("c", "q8_0"), ("c", "q4_0")]
    for o in options:
        for key, kind in (("fits", bool), ("n_gpu_layers", int), ("host_bytes", int), ("gpu_bytes", int),
                          ("tokens_per_s", float), ("speculative_tokens_per_s", float), ("quality", str),
                          ("allowed", bool), ("chosen", bool), ("note", str)):
            assert isinstance(o[key], kind), key
        if o["fits"]:
            assert o["host_bytes"] <= out["host_budget"] and o["gpu_bytes"] <= out["vram_budget"]
    (chosen,) = [o for o in options if o["chosen"]]
    assert chosen["n_gpu_layers"] == out["target"]["n_gpu_layers"] and chosen["type_k"] == out["target"]["type_k"]
    assert chosen["speculative_tokens_per_s"] == pytest.approx(out["speculative_tokens_per_s"])
    assert chosen["gpu_bytes"] == out["memory"]["gpu_bytes"]


def test_plan_text_lists_the_placements_and_why(qwen7b: Path, real_models, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_args(qwen7b, real_models, "--no-kv-quant")) == 0
    text = capsys.readouterr().out
    block = text[text.index("placements ("):text.index("\nwhy:")].splitlines()
    rows = [line for line in block if line.startswith("  ") and not line.startswith("     ")]
    assert [r.split(".")[0].strip() for r in rows] == ["a", "b", "c-q8_0", "c-q4_0"]  # what --offload takes
    assert all("tok/s" in r and "host" in r and "GPU" in r for r in rows)
    assert sum("<- chosen" in r for r in rows) == 1 and "<- chosen" in rows[0]  # partial offload, no KV quantization
    assert text.count("not allowed: KV quantization is off (--no-kv-quant)") == 2
    assert "the fastest that fits" in text
    assert "placement a (partial offload) chosen" in text


def test_a_target_that_fits_the_gpu_lists_no_placements(qwen7b: Path, real_models,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "-m", str(real_models.qwen_05b), "--profile", "rtx3060-laptop", "--vram", "3GiB", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["target"]["n_gpu_layers"] == -1 and out["placements"] == []


def test_offload_pins_a_placement_in_the_plan(qwen7b: Path, real_models, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_args(qwen7b, real_models, "--json")) == 0
    fastest = json.loads(capsys.readouterr().out)
    assert [o["key"] for o in fastest["placements"] if o["chosen"]] != ["b"]  # so pinning b changes the plan
    assert main(_args(qwen7b, real_models, "--json", "--offload", "b")) == 0
    out = json.loads(capsys.readouterr().out)
    (chosen,) = [o for o in out["placements"] if o["chosen"]]
    assert chosen["key"] == "b" and chosen["note"].startswith("pinned by --offload")
    assert out["target"]["n_gpu_layers"] == 0 and out["draft"]["n_gpu_layers"] == chosen["draft_gpu_layers"]
    assert main(_args(qwen7b, real_models, "--offload", "b")) == 0
    assert "placement b (target on CPU threads) pinned by --offload" in capsys.readouterr().out


def test_offload_that_cannot_apply_is_refused_in_one_line(qwen7b: Path, real_models,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_args(qwen7b, real_models, "--no-kv-quant", "--offload", "c-q4_0")) != 0
    err = capsys.readouterr().err
    assert "--offload c-q4_0" in err and "not allowed" in err and "placements that fit here: a, b." in err
    assert len(err.strip().splitlines()) == 1
    assert main(["plan", "-m", str(real_models.qwen_05b), "--profile", "rtx3060-laptop", "--vram", "3GiB",
                 "--offload", "a"]) != 0
    assert "the target fits the GPU budget whole" in capsys.readouterr().err
    assert main(_args(qwen7b, real_models, "--offload", "b", "--engine", "torch")) != 0
    assert "--offload picks how llama.cpp splits a GGUF target" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(_args(qwen7b, real_models, "--offload", "d"))
    assert exc.value.code == 2
    assert "invalid choice: 'd' (choose from 'a', 'b', 'c-q8_0', 'c-q4_0')" in capsys.readouterr().err.replace('"', "'")


@pytest.mark.parametrize("command", ["run", "serve", "chat", "plan"])
def test_offload_is_documented_where_a_model_is_opened(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--offload PLACEMENT" in text and "c-q8_0/c-q4_0 partial offload with that quantized KV cache" in text
