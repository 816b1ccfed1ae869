"""``tandem serve --parallel N`` (``-np``): parsed, checked, and its default."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tandem.app.commands import serve
from tandem.errors import TandemError
from tandem.runtime.engine.spec import EngineSpec


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    return parser.parse_args(["serve", "-m", "model.gguf", *argv])


def test_parallel_flag_is_parsed_and_checked() -> None:
    assert _parse("--parallel", "3").parallel == 3
    assert _parse("-np", "2").parallel == 2
    assert _parse().parallel is None  # chosen from the memory plan
    for bad in ("0", "65", "-1"):
        with pytest.raises(TandemError, match="--parallel"):
            serve.check_args(_parse("--parallel", bad))


def test_default_parallel_comes_from_the_plan(real_models, stories260k: Path) -> None:
    assert serve.default_parallel(EngineSpec(real_models.qwen_05b, budget="16GiB", n_ctx=1024)) == 4
    # a drafter model serves one sequence: it keeps the default at 1
    assert serve.default_parallel(EngineSpec(real_models.qwen_05b, drafter=stories260k, n_ctx=1024)) == 1
