#!/usr/bin/env bash
# Print the folder that holds llama-cpp-python's wheel built for this CPU, building it
# first when no cached one matches.
#
# llama-cpp-python ships no binary wheels on the package index: pip, pipx and uv build it
# from source with the CMake flags in CMAKE_ARGS (packaging/llama_flags.sh: this CPU's,
# portable, AMX off, llamafile off; CUDA's where a GPU and nvcc are). The built wheel is kept in a cache folder keyed by the version
# (pyproject.toml's pin), those flags and the Python version, so the next setup takes
# seconds and a machine of another kind (or a change of flags) builds its own. The sdist
# is kept beside it (the RPC server compiles against its headers).
#
# Usage: bash packaging/llama_wheel.sh [PYTHON]    (PYTHON has pip; default python3)
# Messages go to standard error; standard output is the folder alone.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-python3}"
VERSION=$(grep -o 'llama-cpp-python==[0-9.]*' pyproject.toml | cut -d= -f3)
# This CPU's flags, plus CUDA's where an NVIDIA GPU and a CUDA toolkit are (packaging/
# cuda_flags.sh: that GPU's architecture only, flash attention kernels on; TANDEM_CUDA=0|1
# overrides). TANDEM_LLAMA_SDIST=PATH builds offline from that llama-cpp-python source archive,
# with the build tools PYTHON already has (scikit-build-core, cmake, ninja): offline, pip
# cannot fetch them into an isolated build environment.
if [ -z "${CMAKE_ARGS:-}" ]; then
    CMAKE_ARGS=$(bash packaging/llama_flags.sh)
fi
export CMAKE_ARGS
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || echo 2)}"
key=$(printf '%s %s %s' "$VERSION" "$CMAKE_ARGS" "$("$PY" -c 'import sys; print(sys.version_info[:2])')" | sha256sum | cut -c1-16)
WHEELS="${XDG_CACHE_HOME:-$HOME/.cache}/tandem-build/llama-cpp-python-$key"
if ! ls "$WHEELS"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    case "$CMAKE_ARGS" in
        *GGML_CUDA=ON*) echo "Building llama.cpp for this CPU and its NVIDIA GPU (once; about 4 minutes on 16 cores, longer on fewer): $CMAKE_ARGS" >&2 ;;
        *) echo "Building llama.cpp for this CPU (once; about 10 minutes on 2 cores): $CMAKE_ARGS" >&2 ;;
    esac
    rm -rf "$WHEELS.tmp"
    isolation=()
    if [ -n "${TANDEM_LLAMA_SDIST:-}" ]; then
        mkdir -p "$WHEELS.tmp/src" && cp "$TANDEM_LLAMA_SDIST" "$WHEELS.tmp/src/llama_cpp_python-$VERSION.tar.gz"
        isolation=(--no-build-isolation)
    else
        "$PY" -m pip download --quiet --no-deps --no-binary :all: \
            -d "$WHEELS.tmp/src" "llama-cpp-python==$VERSION" >&2
    fi
    "$PY" -m pip wheel --quiet --no-deps --no-cache-dir "${isolation[@]}" \
        -w "$WHEELS.tmp" "$WHEELS.tmp/src/llama_cpp_python-$VERSION.tar.gz" >&2
    rm -rf "$WHEELS" && mv "$WHEELS.tmp" "$WHEELS"
    printf '%s\n' "$CMAKE_ARGS" > "$WHEELS/CMAKE_ARGS"
fi
echo "$WHEELS"
