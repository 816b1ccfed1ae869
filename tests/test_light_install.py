"""The default install (no extras) runs GGUF models: `tandem --help`, `run`, `plan`,
`models`, `serve` and `chat` work with torch, onnxruntime, onnx, safetensors, tokenizers
and matplotlib hidden, and each feature that needs one of them says, in one line, which
extra to install.

The extras are hidden by tests/without_extras/sitecustomize.py (on PYTHONPATH, Python
runs it at start-up): `import torch` then fails as it does where torch is not installed.
tests/test_offline_install.py installs the default dependencies alone into a real venv."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
import urllib.request
import uuid
from pathlib import Path

import pytest
from live_server import free_port
from tui_pilot import wait_for

ROOT = Path(__file__).resolve().parents[1]
BLOCKER = ROOT / "tests" / "without_extras"
HEAVY = ("torch", "onnxruntime", "onnx", "safetensors", "tokenizers", "matplotlib")
IN_CI = os.environ.get("CI", "").lower() == "true"


def light_env(home: Path) -> dict[str, str]:
    """This environment, with the extras hidden from every Python process started in it."""
    env = dict(os.environ, TANDEM_HOME=str(home), HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(BLOCKER), *filter(None, [env.get("PYTHONPATH")])])
    return env


def tandem(home: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem.app.cli", *args], env=light_env(home),
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def test_the_blocker_hides_every_extra(isolated_home: Path) -> None:
    code = "import importlib.util as u, sys; print([m for m in sys.argv[1:] if u.find_spec(m)])"
    out = subprocess.run([sys.executable, "-c", code, *HEAVY, "numpy", "llama_cpp", "textual"],
                         env=light_env(isolated_home), capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "['numpy', 'llama_cpp', 'textual']"


TORCH_MODULES = {
    "tandem.kernels.hadamard", "tandem.kernels.kv_budget", "tandem.kernels.kv_quant",
    "tandem.models.moefy",
    "tandem.runtime.backends.onnx_export",
    "tandem.runtime.backends.torch_engine.backend", "tandem.runtime.backends.torch_engine.cache",
    "tandem.runtime.backends.torch_engine.decoder", "tandem.runtime.backends.torch_engine.loader",
    "tandem.runtime.kv.compress", "tandem.runtime.kv.segments",
    "tandem.runtime.moe.expert_cache", "tandem.runtime.moe.expert_store", "tandem.runtime.backends.torch_engine.moe_layer",
    "tandem.runtime.speculative.drafters.distill",
}
"""The modules that import torch at their top: the torch engine and what runs on it. The
light path never imports them; every other module imports with no extra installed."""


def test_only_the_torch_modules_need_an_extra_to_import(isolated_home: Path) -> None:
    code = """
import importlib, pathlib, sys
roots = [pathlib.Path(top) for top in ("app", "runtime", "kernels", "models")]
for p in sorted([*pathlib.Path().glob("*.py"), *(q for top in roots for q in top.rglob("*.py"))]):
    name = ".".join(["tandem", *[x for x in p.with_suffix("").parts if x != "__init__"]])
    try:
        importlib.import_module(name)
    except ImportError as exc:
        print(name, exc.name)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=light_env(isolated_home),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    failed = dict(line.split() for line in out.stdout.splitlines())
    assert set(failed) == TORCH_MODULES, f"unexpected: {set(failed) ^ TORCH_MODULES}"
    assert set(failed.values()) == {"torch"}


def test_default_dependencies_leave_the_heavy_ones_to_extras() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {d.split("==")[0].split(">=")[0].split("[")[0].strip() for d in project["dependencies"]}
    assert "llama-cpp-python" in names and "textual" in names and "huggingface-hub" in names
    assert not names & {*HEAVY, "onnxruntime-gpu"}
    extras = project["optional-dependencies"]
    assert {"torch", "onnx", "gpu", "plots", "all", "dev"} <= set(extras)
    assert extras["all"] == ["tandem[torch,onnx,plots]"]
    # onnxruntime and onnxruntime-gpu write the same files: no extra may bring both.
    for name, deps in extras.items():
        assert not (any(d.startswith("onnxruntime>") for d in deps) and any("onnxruntime-gpu" in d for d in deps)), name


def test_help_run_and_plan_on_a_gguf_without_extras(isolated_home: Path, real_models) -> None:
    help_ = tandem(isolated_home, "--help", timeout=60)
    assert help_.returncode == 0 and "export-onnx" in help_.stdout, help_.stderr
    run = tandem(isolated_home, "run", "-m", str(real_models.smollm2), "-n", "8", "--temp", "0",
                 "--threads", "1", "--json", "-p", "Say hello.")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert len(out["token_ids"]) == 8 and out["text"].strip()
    plan = tandem(isolated_home, "plan", "-m", str(real_models.smollm2), "--draft", str(real_models.smollm2))
    assert plan.returncode == 0 and "fits:    yes" in plan.stdout, plan.stderr
    models = tandem(isolated_home, "models", timeout=60)
    assert models.returncode == 0, models.stderr


def test_the_gguf_path_imports_no_extra_even_where_installed(isolated_home: Path, stories260k: Path) -> None:
    """Where the extras are installed, a GGUF run still never imports them: `import torch`
    alone takes seconds, which a user who runs GGUF files would pay for nothing."""
    code = ("import sys; from tandem.app.cli import main;"
            "rc = main(['run', '-m', sys.argv[1], '-n', '4', '--temp', '0', '--threads', '1', '-q', '-p', 'Once']);"
            f"print(rc, sorted(m for m in sys.modules if m.partition('.')[0] in {HEAVY!r}))")
    out = subprocess.run([sys.executable, "-c", code, str(stories260k)], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, TANDEM_HOME=str(isolated_home)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "0 []"


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.load(resp)


def test_serve_answers_without_extras(isolated_home: Path, stories260k: Path) -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tandem.app.cli", "serve", "-m", str(stories260k),
                             "--port", str(port), "--threads", "1"],
                            env=light_env(isolated_home), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:  # wait for the condition (the server answers), not for a fixed time
            if proc.poll() is not None:
                raise AssertionError(f"tandem serve exited: {proc.communicate()[1]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as resp:
                    models = json.load(resp)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert models["data"]
        answer = _post(f"http://127.0.0.1:{port}/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "Once upon a time"}], "max_tokens": 8,
                        "temperature": 0})
        assert answer["choices"][0]["message"]["content"]
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert "Traceback" not in err, err


def _chat_in_tmux(home: Path, chat_args: list[str], steps) -> str:
    """Run `tandem chat CHAT_ARGS` with the extras hidden in a private tmux server, call
    ``steps(tmux)``, and return the pane once the app has exited."""
    if shutil.which("tmux") is None:
        message = "tmux is not installed (packaging/bootstrap.sh installs it)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    socket = f"tandem-light-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def tmux(*args: str) -> str:
        out = subprocess.run(["tmux", "-L", socket, *args], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, f"tmux {args[0]} failed: {out.stderr}"
        return out.stdout

    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in light_env(home).items()
                   if k in ("TANDEM_HOME", "HF_HUB_OFFLINE", "PYTHONPATH"))
    command = (f"env {env} TERM=xterm-256color {shlex.quote(sys.executable)} -m tandem.app.cli chat "
               f"{shlex.join(chat_args)}; echo TANDEM-EXITED $?; sleep 30")
    try:
        tmux("new-session", "-d", "-s", "chat", "-x", "110", "-y", "30", command)
        steps(tmux)
        tmux("send-keys", "-t", "chat", "C-q")
        return wait_for(tmux, "TANDEM-EXITED")
    finally:
        subprocess.run(["tmux", "-L", socket, "kill-server"], capture_output=True, timeout=30)


def test_chat_in_a_terminal_without_extras(isolated_home: Path, stories260k: Path) -> None:
    def chat(tmux) -> None:
        wait_for(tmux, "Model stories260K")
        tmux("send-keys", "-t", "chat", "-l", "Once upon a time")
        tmux("send-keys", "-t", "chat", "Enter")
        wait_for(tmux, "16 tokens")

    pane = _chat_in_tmux(isolated_home, ["-m", str(stories260k), "--temp", "0", "-n", "16", "--threads", "1"], chat)
    assert "TANDEM-EXITED 0" in pane and "Traceback" not in pane, pane


def test_chat_names_a_missing_extra_as_written(isolated_home: Path, stories260k: Path) -> None:
    """The chat app's status line shows the one-line message, its `[torch]` intact (not
    read as a markup tag)."""
    want = 'needs torch, which is not installed: pip install "tandem[torch]"'
    seen: list[str] = []

    def status_line(tmux) -> None:
        """The status line under the error's notification, once the notification (which
        covers it for a few seconds) has gone."""
        wait_for(tmux, "Could not load")
        deadline = time.monotonic() + 60
        while True:
            pane = tmux("capture-pane", "-p", "-t", "chat")
            seen[:] = [" ".join(line.strip(" ▕") for line in pane.splitlines())]
            if want in seen[0] or time.monotonic() > deadline:
                return
            time.sleep(0.2)

    pane = _chat_in_tmux(isolated_home, ["-m", str(stories260k), "--engine", "torch", "--threads", "1"],
                         status_line)
    assert want in seen[0], seen[0]
    assert "TANDEM-EXITED 0" in pane and "Traceback" not in pane, pane


@pytest.mark.parametrize(("args", "extra"), [
    (["run", "--engine", "torch", "-p", "hi"], "torch"),
    (["run", "--engine", "torch", "--kv-compress", "kivi4", "-p", "hi"], "torch"),
    (["run", "--engine", "torch", "--moe-offload", "-p", "hi"], "torch"),
    (["export-onnx", "-o", "{tmp}/onnx"], "torch,onnx"),
    (["distill", "-o", "{tmp}/d.gguf"], "torch"),
    (["moefy", "-o", "{tmp}/m.gguf"], "torch"),
    (["bench", "--plot", "{tmp}/p.png"], "plots"),
])
def test_a_feature_that_needs_a_missing_extra_names_it(args: list[str], extra: str, isolated_home: Path,
                                                      stories260k: Path, tmp_path: Path) -> None:
    args = [a.format(tmp=tmp_path) for a in args]
    model_flag = [] if args[0] in ("export-onnx", "distill", "moefy") else ["-m"]
    out = tandem(isolated_home, args[0], *model_flag, str(stories260k), *args[1:], timeout=120)
    assert out.returncode == 8, (out.stdout, out.stderr)
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("tandem: error: ") and f'pip install "tandem[{extra}]"' in line, line
    assert not list(tmp_path.iterdir()), "nothing is written when the extra is missing"


@pytest.mark.parametrize(("files", "extra"), [
    ({"model.onnx": b"", "tandem-onnx.json": b"{}"}, "onnx"),
    ({"config.json": b"{}", "model.safetensors": b""}, "torch"),
])
def test_a_model_that_needs_a_missing_extra_names_it(files: dict[str, bytes], extra: str, isolated_home: Path,
                                                     tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    for name, data in files.items():
        (folder / name).write_bytes(data)
    out = tandem(isolated_home, "run", "-m", str(folder), "-p", "hi", timeout=120)
    assert out.returncode == 8, (out.stdout, out.stderr)
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("tandem: error: ") and f'pip install "tandem[{extra}]"' in line, line


def test_an_onnx_model_runs_with_the_onnx_extra_alone(isolated_home: Path, stories260k: Path, tmp_path: Path) -> None:
    """[onnx] without [torch]: the ONNX backend opens an export without importing torch
    (only the exporter needs it; the export is made here, where torch is installed)."""
    from tandem.runtime.backends.onnx_export import export_onnx

    export_onnx(stories260k, tmp_path / "onnx", n_ctx=128)
    env = dict(light_env(isolated_home), TANDEM_HIDE_MODULES="torch safetensors matplotlib")
    out = subprocess.run([sys.executable, "-m", "tandem.app.cli", "run", "-m", str(tmp_path / "onnx"), "-n", "6",
                          "--temp", "0", "--threads", "1", "--json", "-p", "Once upon a time"],
                         env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["token_ids"]) == 6


def _cli_with(monkeypatch: pytest.MonkeyPatch, error: BaseException):
    """`tandem.app.cli.main` with one command, ``thing``, that raises ``error``."""
    import argparse

    from tandem.app import cli

    def raise_it(args: argparse.Namespace) -> int:
        raise error

    def parser(command: str | None) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(prog="tandem")
        p.add_subparsers(dest="command").add_parser("thing").set_defaults(func=raise_it)
        return p

    monkeypatch.setattr(cli, "build_parser", parser)
    return cli.main


def test_an_unchecked_import_of_an_extra_still_names_it(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture) -> None:
    main = _cli_with(monkeypatch, ModuleNotFoundError("No module named 'onnxruntime'", name="onnxruntime"))
    assert main(["thing"]) == 8
    assert capsys.readouterr().err == ('tandem: error: tandem thing needs onnxruntime, which is not installed: '
                                       'pip install "tandem[onnx]"\n')


def test_a_missing_module_that_is_no_extra_is_a_bug_not_a_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    main = _cli_with(monkeypatch, ModuleNotFoundError("No module named 'tandem.gone'", name="tandem.gone"))
    with pytest.raises(ModuleNotFoundError):
        main(["thing"])
