#!/usr/bin/env bash
# Set up a development environment in .venv: Tandem editable, with its dev tools.
# llama-cpp-python builds from source; CMAKE_ARGS trims what it builds, and pip caches
# the wheel so the next run takes seconds. torch is pinned to the local CPU build.
set -euo pipefail
cd "$(dirname "$0")/.."
# The terminal-app tests drive `tandem chat` in a real tmux session.
if ! command -v tmux >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq tmux) >/dev/null 2>&1 || echo "warning: could not install tmux" >&2
fi
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip wheel setuptools
export CMAKE_ARGS="${CMAKE_ARGS:--DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || echo 2)}"
.venv/bin/python -m pip install --quiet -e ".[dev]"
echo "Tandem is installed in .venv: try .venv/bin/tandem --help"
