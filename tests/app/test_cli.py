"""`tandem run`, `models`, `pull` from the outside: real processes, real exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest


def tandem(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tandem.app.cli", *args],
        capture_output=True, text=True, timeout=180, input=stdin, env=dict(os.environ),
    )


def assert_clean_error(r: subprocess.CompletedProcess, needle: str) -> None:
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("tandem: error:"), r.stderr
    assert needle in lines[0], lines[0]


def test_help_lists_commands() -> None:
    r = tandem("--help")
    assert r.returncode == 0
    for cmd in ("run", "models", "pull"):
        assert cmd in r.stdout


def test_version() -> None:
    from importlib.metadata import version

    r = tandem("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"tandem {version('tandem')}"


def test_models_and_rm_from_the_command_line(stories260k: Path, isolated_home: Path) -> None:
    from tandem.models.paths import models_dir

    hostile = models_dir() / "evil\x1b]52;c;aGk=\x07name.gguf"  # a file name that would set the clipboard
    hostile.write_bytes(stories260k.read_bytes())
    listed = tandem("models")
    assert listed.returncode == 0 and "\x1b" not in listed.stdout and "\x07" not in listed.stdout
    assert "evil" in listed.stdout and "name" in listed.stdout
    asked = tandem("rm", str(hostile), stdin="")  # not a terminal, and no --yes: nothing deleted
    assert_clean_error(asked, "--yes")
    assert hostile.exists()
    gone = tandem("rm", str(hostile), "--yes")
    assert gone.returncode == 0 and "MiB freed" in gone.stdout and "\x1b" not in gone.stdout
    assert not hostile.exists()
    assert_clean_error(tandem("rm", "no-such-model", "-y"), "not in the store")


def test_run_streams_the_documented_continuation(stories260k: Path) -> None:
    r = tandem("run", "-m", str(stories260k), "-p", "Once upon a time", "-n", "12")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(", there was a little girl named Lily")


def test_run_json_has_text_ids_and_stats(stories260k: Path) -> None:
    r = tandem("run", "-m", str(stories260k), "-p", "Once upon a time", "-n", "8", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["text"].startswith(", there was")
    assert len(out["token_ids"]) == 8
    stats = out["stats"]
    assert stats["generated_tokens"] == 8 and stats["prompt_tokens"] == 5
    assert stats["tokens_per_s"] > 0 and stats["finish_reason"] == "length"


def test_run_takes_the_prompt_after_the_model_as_ollama_does(stories260k: Path) -> None:
    flag = tandem("run", "-m", str(stories260k), "-p", "Once upon a time", "-n", "8", "--json")
    words = tandem("run", "-m", str(stories260k), "Once", "upon", "a", "time", "-n", "8", "--json")
    quoted = tandem("run", "-m", str(stories260k), "-n", "8", "--json", "Once upon a time")
    assert flag.returncode == words.returncode == quoted.returncode == 0, flag.stderr + words.stderr + quoted.stderr
    ids = json.loads(flag.stdout)["token_ids"]
    assert json.loads(words.stdout)["token_ids"] == ids == json.loads(quoted.stdout)["token_ids"]
    assert json.loads(words.stdout)["prompt"] == "Once upon a time"
    assert_clean_error(tandem("run", "-m", str(stories260k), "-p", "Once", "upon"), "once")


def test_run_reads_prompt_from_stdin(stories260k: Path) -> None:
    r = tandem("run", "-m", str(stories260k), "-n", "6", stdin="Once upon a time")
    assert r.returncode == 0 and r.stdout.startswith(", there was")


def test_seeded_sampling_repeats(stories260k: Path) -> None:
    args = ("run", "-m", str(stories260k), "-p", "Once upon a time", "-n", "20", "--temp", "0.9", "--seed", "3", "--json")
    assert json.loads(tandem(*args).stdout)["token_ids"] == json.loads(tandem(*args).stdout)["token_ids"]


def test_bad_inputs_give_one_clear_message(tmp_path: Path, stories260k: Path) -> None:
    assert_clean_error(tandem("run", "-m", str(tmp_path / "missing.gguf"), "-p", "x"), "No model")
    text = tmp_path / "readme.gguf"
    text.write_text("not a model")
    assert_clean_error(tandem("run", "-m", str(text), "-p", "x"), "not a GGUF")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(stories260k.read_bytes()[:400_000])
    assert_clean_error(tandem("run", "-m", str(cut), "-p", "x"), "truncated")
    foo = tmp_path / "foo.gguf"
    w = gguf.GGUFWriter(str(foo), "not-an-arch")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    assert_clean_error(tandem("run", "-m", str(foo), "-p", "x"), "not-an-arch")
    assert_clean_error(tandem("run", "-m", str(stories260k), "-p", ""), "empty")
    long_prompt = "Once upon a time " * 400
    assert_clean_error(tandem("run", "-m", str(stories260k), "--ctx", "256", "-p", long_prompt), "context")


@pytest.mark.parametrize("args", [("run",), ("run", "-m")])
def test_usage_errors_exit_2(args: tuple[str, ...]) -> None:
    r = tandem(*args)
    assert r.returncode == 2 and "usage:" in r.stderr


def test_run_chat_serve_share_the_engine_flags_and_defaults(stories260k: Path) -> None:
    """One set of flags and defaults: the same command line gives the same EngineSpec in
    every front end (the server only adds per-client isolation)."""
    from dataclasses import replace

    from tandem.app.cli import build_parser
    from tandem.app.commands.engine_flags import spec_from_args
    from tandem.app.server.loaded_models import isolated

    parser = build_parser()
    common = ["-m", str(stories260k)]
    specs = {cmd: spec_from_args(parser.parse_args([cmd, *common])) for cmd in ("run", "chat", "serve")}
    assert specs["run"] == specs["chat"] == specs["serve"]
    assert specs["run"].draft_mode == "auto" and specs["run"].n_ctx is None and specs["run"].placement == "auto"
    assert isolated(specs["serve"]) == replace(specs["run"], suffix_memory="request")
    flags = ["--budget", "1GiB", "--draft-mode", "ngram", "--placement", "cpu", "--kv-type", "q8_0",
             "--draft-max", "4", "--ctx", "512"]
    specs = {cmd: spec_from_args(parser.parse_args([cmd, *common, *flags])) for cmd in ("run", "chat", "serve")}
    assert specs["run"] == specs["chat"] == specs["serve"]
    assert (specs["serve"].budget, specs["serve"].draft_mode, specs["serve"].kv_type) == ("1GiB", "ngram", "q8_0")


def test_more_threads_than_cores_are_the_cores_with_a_notice(stories260k: Path, capsys) -> None:
    """--threads 1000 on a 2-core box started 1001 threads (a kernel probe ran so for
    minutes in the background): the engine gets the cores it may run on, and says so."""
    from tandem.app.cli import build_parser
    from tandem.app.commands.engine_flags import spec_from_args
    from tandem.runtime.machine import cpu_cores

    parser = build_parser()
    spec = spec_from_args(parser.parse_args(["run", "-m", str(stories260k), "--threads", "1000"]))
    assert spec.threads == cpu_cores()
    assert f"--threads 1000 is more than the {cpu_cores()} cores" in capsys.readouterr().err
    assert spec_from_args(parser.parse_args(["run", "-m", str(stories260k), "--threads", "1"])).threads == 1
    assert capsys.readouterr().err == ""


def test_a_drafter_the_mode_leaves_unused_is_said(stories260k: Path, capsys) -> None:
    from tandem.app.cli import build_parser
    from tandem.app.commands.engine_flags import spec_from_args

    parser = build_parser()
    spec_from_args(parser.parse_args(["run", "-m", str(stories260k), "--draft", str(stories260k),
                                      "--draft-mode", "ngram"]))
    assert "is not used with --draft-mode ngram (model-free drafting only)" in capsys.readouterr().err
    spec_from_args(parser.parse_args(["run", "-m", str(stories260k), "--draft", str(stories260k)]))
    assert capsys.readouterr().err == ""


def test_plan_lists_every_technique_with_its_quality_cost(stories260k: Path, stories_moe: Path) -> None:
    r = tandem("plan", "-m", str(stories260k), "--ctx", "512", "--json")
    assert r.returncode == 0, r.stderr
    options = {o["flag"]: o for o in json.loads(r.stdout)["options"]}
    assert options["--kv-type f16"]["chosen"]
    assert "--kv-type q8_0" not in options  # 8-wide heads: llama.cpp's 32-value blocks do not fit
    kivi = options["--engine torch --kv-compress kivi4"]
    assert "KL 0.0019" in kivi["quality"] and kivi["bytes"] < options["--engine torch --kv-compress none"]["bytes"]
    r = tandem("plan", "-m", str(stories_moe), "--ctx", "512", "--engine", "torch", "--device", "cpu",
               "--moe-offload", "25%")
    assert r.returncode == 0, r.stderr
    assert "engine:  torch on cpu" in r.stdout and "expert cache" in r.stdout and "lossless" in r.stdout
    assert "--engine torch --moe-offload 25% --moe-low-bits" in r.stdout
    r = tandem("plan", "-m", str(stories260k), "--engine", "torch", "--budget", "50MiB")
    assert r.returncode == 6 and "fits:    NO" in r.stdout and "--kv-compress" in r.stdout


def test_chats_lists_shows_and_searches_the_saved_chats(isolated_home: Path) -> None:
    from tandem.app.history.database import History, default_path

    assert "No saved chats" in tandem("chats").stdout and not default_path().exists()  # nothing created
    with History() as history:
        first = history.create_chat("Rivers \x1b]52;c;aGk=\x07of Europe")  # a title that would set the clipboard
        history.add_message(first.id, "user", "Name a long river.")
        history.add_message(first.id, "assistant", "The Danube.\x1b[2J Also the Rhine.")
        second = history.create_chat("Cats")
        history.add_message(second.id, "user", "A fact about cats?")
    listed = tandem("chats")
    assert listed.returncode == 0 and "\x1b" not in listed.stdout and "\x07" not in listed.stdout
    assert "Rivers" in listed.stdout and "Cats" in listed.stdout
    shown = tandem("chats", "show", str(first.id))
    assert shown.returncode == 0 and "## Assistant" in shown.stdout and "The Danube. Also the Rhine." in shown.stdout
    assert "\x1b" not in shown.stdout
    whole = json.loads(tandem("chats", "show", str(first.id), "--json").stdout)
    assert whole["messages"][1]["content"] == "The Danube.\x1b[2J Also the Rhine."  # JSON keeps the text, escaped
    found = tandem("chats", "search", "danub")
    assert found.returncode == 0 and f"{first.id}" in found.stdout and "[Danube]" in found.stdout
    assert json.loads(tandem("chats", "--json", "search", "cats").stdout)[0]["chat_id"] == second.id
    assert tandem("chats", "search", "nothing-like-it").returncode == 1
    assert_clean_error(tandem("chats", "show", "999"), "No chat 999")


def test_ctrl_c_while_the_commands_load_is_one_line(monkeypatch, capsys) -> None:
    """Ctrl+C in the first 0.3 s of `tandem serve` (the sub-command still importing)
    printed a KeyboardInterrupt traceback."""
    from tandem.app import cli

    def interrupted(command: str | None) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["serve"]) == 130
    assert capsys.readouterr().err == "\ntandem: interrupted\n"


def test_the_command_table_names_every_sub_command() -> None:
    """`tandem --help` lists what the modules register, in the table's order: a command
    added to a module but not to the table could never be run."""
    import argparse

    from tandem.app.cli import COMMANDS, build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == list(COMMANDS)
    for name, module in COMMANDS.items():  # each name parses with only its own module loaded
        only = next(a for a in build_parser(name)._actions if isinstance(a, argparse._SubParsersAction))
        assert name in only.choices and {m for m in COMMANDS.values() if m != module}.isdisjoint(
            {COMMANDS[n] for n in only.choices})


@pytest.mark.parametrize("command", ["chat", "serve", "models", "chats"])
def test_parsing_a_command_loads_neither_numpy_nor_llama_cpp(command: str) -> None:
    """The parser imported every command module and with them the runtime: 0.65 s on a
    2-core AVX2 EPYC before `tandem chat` could draw its input box. Now a command's
    parser loads its own module, and these four leave numpy and llama.cpp to the work."""
    code = (f"import sys\nfrom tandem.app.cli import build_parser\nbuild_parser({command!r})\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'numpy', 'llama_cpp', 'gguf', 'jinja2', "
            "'llguidance', 'textual'}), sorted(m for m in sys.modules if m.startswith('tandem.app.commands.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    heavy, commands = out.stdout.strip().split("] [")
    assert heavy == "[", out.stdout
    assert f"tandem.app.commands.{command}'" in commands and "tandem.app.commands.bench'" not in commands


def test_a_typo_lists_every_command() -> None:
    r = tandem("chta")
    assert r.returncode == 2 and "invalid choice: 'chta'" in r.stderr and "'chat'" in r.stderr


def test_models_shows_how_each_file_is_quantized(stories260k: Path, real_models, isolated_home: Path) -> None:
    """As `ollama list` and LM Studio do: the llama.cpp file type the hub names files by, or
    for a file without one (the 260K fixture) the type most of its weights are in."""
    from tandem.models.paths import models_dir

    (models_dir() / "coder.gguf").symlink_to(real_models.qwen_15b)
    (models_dir() / "smol.gguf").symlink_to(real_models.smollm2)
    (models_dir() / "tiny.gguf").symlink_to(stories260k)
    listed = tandem("models", "--json")
    assert listed.returncode == 0, listed.stderr
    quant = {m["name"]: m["quantization"] for m in json.loads(listed.stdout)}
    assert quant == {"coder": "Q4_K_M", "smol": "Q4_1", "tiny": "F32"}
    text = tandem("models").stdout
    assert any(line.startswith("coder ") and " Q4_K_M " in line for line in text.splitlines()), text
