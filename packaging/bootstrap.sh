#!/usr/bin/env bash
# Set up a development environment in .venv: Tandem editable, with every extra and its dev
# tools (a user's install is lighter: README, "Install").
#
# llama-cpp-python is built from source with flags chosen for this CPU
# (packaging/cpu_flags.sh: portable, AMX off, llamafile off). The built wheel is kept in
# a cache folder keyed by those flags (packaging/llama_wheel.sh), so the next run takes
# seconds and a machine of another kind (or a change of flags) builds its own instead of
# reusing a wrong one.
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

LLAMA_CPP_VERSION=$(grep -o 'llama-cpp-python==[0-9.]*' pyproject.toml | cut -d= -f3)
WHEELS=$(bash packaging/llama_wheel.sh .venv/bin/python)
SDIST="$WHEELS/src/llama_cpp_python-$LLAMA_CPP_VERSION.tar.gz"
.venv/bin/python -m pip install --quiet --force-reinstall --no-deps "$WHEELS"/llama_cpp_python-*.whl

# Tandem, every extra and the dev tools (llama_cpp itself imports typing_extensions, used
# below). TANDEM_EXTRAS picks others, e.g. TANDEM_EXTRAS=gpu,plots,dev on an NVIDIA machine.
# onnxruntime and onnxruntime-gpu install the same files: the one not asked for goes first.
EXTRAS="${TANDEM_EXTRAS:-all,dev}"
case ",$EXTRAS," in
    *,gpu,*) drop=onnxruntime ;;
    *) drop=onnxruntime-gpu ;;
esac
if .venv/bin/python -m pip show --quiet "$drop" >/dev/null 2>&1; then
    .venv/bin/python -m pip uninstall --quiet --yes "$drop" onnxruntime onnxruntime-gpu
fi
.venv/bin/python -m pip install --quiet -e ".[$EXTRAS]"
# Tandem's bytecode, compiled now as a wheel install (pip, pipx, uv tool) compiles it: an
# editable install leaves it to each import, and where PYTHONDONTWRITEBYTECODE is set (CI
# images, this project's machines) every start compiled the chat app's modules again
# (0.05-0.08 s before its input box, on a 2-vCPU EPYC). Python checks each file's
# timestamp, so an edited module is still compiled afresh.
.venv/bin/python -m compileall -q -j 0 app runtime kernels models errors.py

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
