"""The documented offline install, for real: a wheelhouse made here
(packaging/wheelhouse.sh: Tandem's wheel, its default dependencies, the llama.cpp wheel
built for this CPU) installs into a fresh venv with the network refused, and that venv
runs a GGUF model without any extra.

The network is refused twice over for the install step: pip gets ``--no-index`` and no
configured index or find-links, and runs in a new network namespace with no interface up
(``unshare -n``, where this user may create one) or, failing that, behind a proxy on a
closed port. Making the wheelhouse needs the package index (pip's cached wheels and the
llama.cpp wheel that bootstrap built are reused): 8-36 s and 54 MB on the 2-core
development machine; the whole test 85 s there under load."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IN_CI = os.environ.get("CI", "").lower() == "true"
HEAVY = ("torch", "onnxruntime", "onnx", "safetensors", "tokenizers", "matplotlib")


def _skip_or_fail(message: str) -> None:
    if IN_CI:
        pytest.fail(message)
    pytest.skip(message)


def offline_prefix() -> tuple[list[str], dict[str, str]]:
    """A command prefix and environment under which nothing reaches the network."""
    dead = "http://127.0.0.1:9"  # the discard port: nothing listens, connections are refused
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k.lower() not in
           ("http_proxy", "https_proxy", "all_proxy", "no_proxy")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_CACHE_DIR="1", PIP_DISABLE_PIP_VERSION_CHECK="1",
               HTTP_PROXY=dead, HTTPS_PROXY=dead, ALL_PROXY=dead, http_proxy=dead, https_proxy=dead)
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "-n", "true"], capture_output=True, timeout=30).returncode == 0:
        return [unshare, "-n"], env
    return [], env


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheelhouse")
    made = subprocess.run(["bash", str(ROOT / "packaging" / "wheelhouse.sh"), str(out)],
                          env=dict(os.environ, PYTHON=sys.executable), capture_output=True, text=True,
                          timeout=1800)
    if made.returncode != 0:
        _skip_or_fail(f"could not make the wheelhouse (needs the package index): {made.stderr[-2000:]}")
    return out


@pytest.mark.slow
def test_wheelhouse_installs_with_the_network_refused(wheelhouse: Path, tmp_path: Path, real_models) -> None:
    wheels = {p.name.split("-")[0].lower() for p in wheelhouse.glob("*.whl")}
    assert {"tandem", "llama_cpp_python", "textual", "numpy"} <= wheels
    assert not wheels & {"torch", "onnxruntime", "onnxruntime_gpu", "matplotlib"}, "the default has no extras"

    venv = tmp_path / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(venv)], check=True, timeout=300, capture_output=True)
    python = venv / "bin" / "python"
    prefix, env = offline_prefix()
    if prefix:  # in the namespace not even a direct connection (no proxy) gets out
        probe = subprocess.run([*prefix, str(python), "-c",
                                "import socket; socket.create_connection(('pypi.org', 443), timeout=5)"],
                               env=env, capture_output=True, text=True, timeout=60)
        assert probe.returncode != 0, "the network was reachable where it must be refused"
    install = subprocess.run([*prefix, str(python), "-m", "pip", "install", "--no-index", "--find-links",
                              str(wheelhouse), "tandem"], env=env, capture_output=True, text=True, timeout=900)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]

    home = tmp_path / "home"
    run_env = dict(env, TANDEM_HOME=str(home), HF_HUB_OFFLINE="1")
    tandem = str(venv / "bin" / "tandem")
    helped = subprocess.run([tandem, "--help"], env=run_env, capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and "chat" in helped.stdout, helped.stderr
    ran = subprocess.run([*prefix, tandem, "run", "-m", str(real_models.smollm2), "-n", "8", "--temp", "0",
                          "--threads", "1", "--json", "-p", "Say hello."],
                         env=run_env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert ran.returncode == 0, ran.stderr
    assert len(json.loads(ran.stdout)["token_ids"]) == 8
    found = subprocess.run([str(python), "-c", "import importlib.util as u, sys;"
                            "print([m for m in sys.argv[1:] if u.find_spec(m)])", *HEAVY],
                           env=run_env, capture_output=True, text=True, check=True, timeout=60)
    assert found.stdout.strip() == "[]", "a default install brought an extra"
    refused = subprocess.run([tandem, "run", "-m", str(real_models.smollm2), "--engine", "torch", "-p", "hi"],
                             env=run_env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert refused.returncode == 8
    assert refused.stderr.strip() == ('tandem: error: --engine torch needs torch, which is not installed: '
                                      'pip install "tandem[torch]"')
