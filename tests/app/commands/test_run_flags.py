"""`tandem run`'s sampling and length flags: a value outside its range is one error line,
-1 means what it means in llama.cpp (a random seed, no token limit), and a prompt that is
not UTF-8 is decoded, not a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tandem.app.cli import build_parser
from tandem.app.commands.run import as_text, token_limit
from tandem.app.commands.sampling_flags import sampling_from_args
from tandem.app.tui.modals import parse_settings
from tandem.app.tui.session import ChatSettings
from tandem.errors import TandemError
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.generate import NO_LIMIT


def _args(*flags: str):
    return build_parser().parse_args(["run", "-m", "x.gguf", *flags])


@pytest.mark.parametrize(("flags", "says"), [
    (("--temp", "nan"), "--temp must be 0 or more"),
    (("--temp", "-1"), "--temp must be 0 or more"),
    (("--top-p", "2"), "--top-p must be between 0 and 1"),
    (("--top-k", "-3"), "--top-k must be 0 or more"),
    (("--min-p", "-1"), "--min-p must be between 0 and 1"),
    (("--repeat-penalty", "0"), "--repeat-penalty must be above 0"),
    (("--repeat-last-n", "-5"), "--repeat-last-n must be -1 or more"),
    (("--presence-penalty", "inf"), "--presence-penalty must be a number"),
])
def test_a_sampling_value_out_of_range_is_one_line(flags: tuple[str, ...], says: str) -> None:
    with pytest.raises(TandemError, match=says):
        sampling_from_args(_args(*flags))


def test_minus_one_is_a_random_seed_and_no_token_limit() -> None:
    assert sampling_from_args(_args("--seed", "-1")).seed is None
    assert sampling_from_args(_args("--seed", "7")).seed == 7
    assert sampling_from_args(_args("--temp", "0.7", "--repeat-last-n", "-1")).repeat_last_n == 0
    assert token_limit(-1) == NO_LIMIT and token_limit(0) == 0 and token_limit(5) == 5
    with pytest.raises(TandemError, match="-n/--max-tokens must be -1"):
        token_limit(-2)


def test_a_prompt_that_is_not_utf8_becomes_text() -> None:
    raw = b"caf\xe9 x".decode("utf-8", "surrogateescape")  # what Python makes of argv and stdin bytes
    assert as_text(raw) == "caf\ufffd x"
    assert as_text("naïve ☕") == "naïve ☕"


def test_the_chat_settings_dialog_refuses_what_the_sampler_cannot_use() -> None:
    base = ChatSettings(SamplingParams(), 512, [])
    form = {"temperature": "0.7", "top_k": "40", "top_p": "0.9", "min_p": "0.05", "repetition_penalty": "1.0",
            "presence_penalty": "0", "frequency_penalty": "0", "seed": "-1", "max_tokens": "100"}
    _, settings = parse_settings("", form, base)
    assert settings.params.seed is None  # -1 failed every reply ("expected non-negative integer")
    for field, value in (("temperature", "nan"), ("repetition_penalty", "0"), ("top_k", "-3"), ("min_p", "2")):
        with pytest.raises(ValueError):
            parse_settings("", {**form, field: value}, base)


def test_run_takes_a_prompt_that_is_not_utf8(real_models) -> None:
    """The whole command: it was a UnicodeEncodeError traceback."""
    r = subprocess.run([sys.executable, "-m", "tandem.app.cli", "run", "-m", str(real_models.smollm2), "-n", "2",
                        "--threads", "1", "-q", "-p", b"caf\xe9 x".decode("utf-8", "surrogateescape")],
                       capture_output=True, timeout=300, cwd=Path(__file__).parent)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    assert b"Traceback" not in r.stderr
