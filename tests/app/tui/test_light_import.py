"""`tandem chat` draws its input box before the runtime loads: importing the app pulls in
Textual and the history, not numpy, llama.cpp or the engine (the model load's worker
imports those once the screen is on)."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY_PACKAGES = ("numpy", "llama_cpp", "jinja2", "llguidance", "gguf")
HEAVY_TANDEM = ("tandem.runtime.chat", "tandem.runtime.generate", "tandem.runtime.engine.builder",
                "tandem.runtime.autocomplete", "tandem.runtime.constrained", "tandem.models.chat_template",
                "tandem.kernels")
LIGHT_TANDEM = ("tandem.kernels", "tandem.kernels.sampling_params")
"""Light modules under a heavy name: the package itself and the numpy-free sampling settings."""


def imported_by(module: str) -> list[str]:
    """The modules a fresh interpreter holds after importing ``module``."""
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)


def heavy(modules: list[str]) -> list[str]:
    return [m for m in modules if m not in LIGHT_TANDEM and (
        m.split(".")[0] in HEAVY_PACKAGES or any(m == h or m.startswith(h + ".") for h in HEAVY_TANDEM))]


def test_importing_the_chat_app_leaves_the_runtime_out() -> None:
    assert heavy(imported_by("tandem.app.tui.app")) == []
