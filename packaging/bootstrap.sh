#!/usr/bin/env bash
# Set up a development environment in .venv: Tandem editable, with its dev tools.
#
# llama-cpp-python is built from source with flags chosen for this CPU
# (packaging/cpu_flags.sh: portable, AMX off, llamafile off). The built wheel is kept in
# a cache folder keyed by those flags, so the next run takes seconds and a machine of
# another kind (or a change of flags) builds its own instead of reusing a wrong one.
# Setup ends with a self-check in a child process: load a quantized model, decode.
set -euo pipefail
cd "$(dirname "$0")/.."
# The terminal-app tests drive `tandem chat` in a real tmux session.
if ! command -v tmux >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq tmux) >/dev/null 2>&1 || echo "warning: could not install tmux" >&2
fi
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip wheel setuptools

LLAMA_CPP_VERSION=0.3.36
export CMAKE_ARGS="${CMAKE_ARGS:-$(bash packaging/cpu_flags.sh)}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || echo 2)}"
key=$(printf '%s %s %s' "$LLAMA_CPP_VERSION" "$CMAKE_ARGS" "$("$PYTHON" -c 'import sys; print(sys.version_info[:2])')" | sha256sum | cut -c1-16)
WHEELS="${XDG_CACHE_HOME:-$HOME/.cache}/tandem-build/llama-cpp-python-$key"
if ! ls "$WHEELS"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    echo "Building llama.cpp for this CPU (once; about 10 minutes on 2 cores): $CMAKE_ARGS" >&2
    rm -rf "$WHEELS.tmp"
    .venv/bin/python -m pip wheel --quiet --no-deps --no-cache-dir --no-binary llama-cpp-python \
        -w "$WHEELS.tmp" "llama-cpp-python==$LLAMA_CPP_VERSION"
    rm -rf "$WHEELS" && mv "$WHEELS.tmp" "$WHEELS"
    printf '%s\n' "$CMAKE_ARGS" > "$WHEELS/CMAKE_ARGS"
fi
.venv/bin/python -m pip install --quiet --force-reinstall --no-deps "$WHEELS"/llama_cpp_python-*.whl
.venv/bin/python -m pip install --quiet -e ".[dev]"
.venv/bin/python -m tandem.runtime.backends.selfcheck
echo "Tandem is installed in .venv: try .venv/bin/tandem --help"
