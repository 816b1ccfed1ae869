#!/usr/bin/env bash
# Set up a development environment in .venv: Tandem editable, with its dev tools.
#
# llama-cpp-python is built from source with flags chosen for this CPU
# (packaging/cpu_flags.sh: portable, AMX off, llamafile off). The built wheel is kept in
# a cache folder keyed by those flags, so the next run takes seconds and a machine of
# another kind (or a change of flags) builds its own instead of reusing a wrong one.
# The RPC backend is built in, with a small RPC server (tandem rpc-server) beside it.
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
# This CPU's flags, plus CUDA's where an NVIDIA GPU and a CUDA toolkit are (packaging/
# cuda_flags.sh: that GPU's architecture only, flash attention kernels on; TANDEM_CUDA=0|1
# overrides). TANDEM_LLAMA_SDIST=PATH builds offline from that llama-cpp-python source archive.
if [ -z "${CMAKE_ARGS:-}" ]; then
    CMAKE_ARGS=$(bash packaging/llama_flags.sh)
fi
export CMAKE_ARGS
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || echo 2)}"
key=$(printf '%s %s %s' "$LLAMA_CPP_VERSION" "$CMAKE_ARGS" "$("$PYTHON" -c 'import sys; print(sys.version_info[:2])')" | sha256sum | cut -c1-16)
WHEELS="${XDG_CACHE_HOME:-$HOME/.cache}/tandem-build/llama-cpp-python-$key"
SDIST="$WHEELS/src/llama_cpp_python-$LLAMA_CPP_VERSION.tar.gz"
if ! ls "$WHEELS"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    case "$CMAKE_ARGS" in
        *GGML_CUDA=ON*) echo "Building llama.cpp for this CPU and its NVIDIA GPU (once; about 4 minutes on 16 cores, longer on fewer): $CMAKE_ARGS" >&2 ;;
        *) echo "Building llama.cpp for this CPU (once; about 10 minutes on 2 cores): $CMAKE_ARGS" >&2 ;;
    esac
    rm -rf "$WHEELS.tmp"
    # The sdist is kept beside the wheel: the RPC server below compiles against its headers.
    if [ -n "${TANDEM_LLAMA_SDIST:-}" ]; then
        mkdir -p "$WHEELS.tmp/src" && cp "$TANDEM_LLAMA_SDIST" "$WHEELS.tmp/src/llama_cpp_python-$LLAMA_CPP_VERSION.tar.gz"
    else
        .venv/bin/python -m pip download --quiet --no-deps --no-binary :all: \
            -d "$WHEELS.tmp/src" "llama-cpp-python==$LLAMA_CPP_VERSION"
    fi
    .venv/bin/python -m pip wheel --quiet --no-deps --no-cache-dir \
        -w "$WHEELS.tmp" "$WHEELS.tmp/src/llama_cpp_python-$LLAMA_CPP_VERSION.tar.gz"
    rm -rf "$WHEELS" && mv "$WHEELS.tmp" "$WHEELS"
    printf '%s\n' "$CMAKE_ARGS" > "$WHEELS/CMAKE_ARGS"
fi
.venv/bin/python -m pip install --quiet --force-reinstall --no-deps "$WHEELS"/llama_cpp_python-*.whl

# Tandem and its dependencies (llama_cpp itself imports typing_extensions, used below).
.venv/bin/python -m pip install --quiet -e ".[dev]"

# tandem-rpc-server (packaging/rpc_server.cpp): llama.cpp's RPC server linked against the
# wheel's own libggml, so it always speaks the client's protocol version. A few seconds
# to compile; cached beside the wheel per source version, installed into .venv/bin.
LIBS=$(.venv/bin/python -c 'import llama_cpp, pathlib; print(pathlib.Path(llama_cpp.__file__).parent / "lib")')
if [ -e "$LIBS/libggml-rpc.so" ]; then
    SERVER="$WHEELS/tandem-rpc-server-$(sha256sum packaging/rpc_server.cpp | cut -c1-12)"
    if [ ! -x "$SERVER" ]; then
        [ -r "$SDIST" ] || .venv/bin/python -m pip download --quiet --no-deps --no-binary :all: \
            -d "$WHEELS/src" "llama-cpp-python==$LLAMA_CPP_VERSION"
        inc=$(mktemp -d)
        tar -xzf "$SDIST" -C "$inc" --strip-components=4 --wildcards \
            "*/vendor/llama.cpp/ggml/include/*.h" "*/vendor/llama.cpp/ggml/src/ggml-backend-impl.h"
        SITE=$(.venv/bin/python -c 'import llama_cpp, os, sys; print(os.path.relpath(os.path.dirname(llama_cpp.__file__), sys.prefix))')
        "${CXX:-c++}" -std=c++17 -O2 -I"$inc/include" -I"$inc/src" packaging/rpc_server.cpp \
            -L"$LIBS" -lggml -lggml-base -Wl,-rpath,"\$ORIGIN/../$SITE/lib" -o "$SERVER.tmp"
        rm -rf "$inc" && mv "$SERVER.tmp" "$SERVER"
    fi
    install -m 755 "$SERVER" .venv/bin/tandem-rpc-server
else
    echo "note: no RPC backend in this llama.cpp build (GGML_RPC off): tandem rpc-server is unavailable" >&2
fi
.venv/bin/python -m tandem.runtime.backends.selfcheck
echo "Tandem is installed in .venv: try .venv/bin/tandem --help"
