#!/usr/bin/env bash
# Make a wheelhouse: one folder with every wheel that installing Tandem needs, so a
# machine with no network installs from it alone.
#
#   bash packaging/wheelhouse.sh DIR [EXTRAS]      # here, with network (e.g. EXTRAS=torch)
#   python3 -m venv ~/tandem && ~/tandem/bin/pip install --no-index --find-links DIR "tandem[EXTRAS]"
#                                                  # there, offline
#
# The offline machine needs the same OS, CPU architecture and Python minor version.
# llama-cpp-python is the wheel built for this CPU (packaging/llama_wheel.sh, reused from
# its cache): for an offline machine of another kind set CMAKE_ARGS from its flags first,
#   CMAKE_ARGS="$(bash packaging/cpu_flags.sh its-cpuinfo.txt)" bash packaging/wheelhouse.sh DIR
# PYTHON: the interpreter that runs pip (default .venv/bin/python, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?usage: bash packaging/wheelhouse.sh DIR [EXTRAS]}"
EXTRAS="${2:-}"
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
mkdir -p "$OUT"
LLAMA=$(bash packaging/llama_wheel.sh "$PY")
cp "$LLAMA"/llama_cpp_python-*.whl "$OUT"/
# pip wheel builds Tandem's own wheel and fetches (or builds) one for every dependency;
# the llama.cpp wheel above wins over the index's source release of the same version.
# Tandem is built from a clean copy of its sources: a stale build/ folder in the checkout
# would otherwise put modules deleted since into the wheel.
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
cp -r app runtime kernels models errors.py pyproject.toml README.md "$src"/
find "$src" -name __pycache__ -prune -exec rm -rf {} +
"$PY" -m pip wheel --quiet --find-links "$OUT" --wheel-dir "$OUT" "$src${EXTRAS:+[$EXTRAS]}"
# The tools a fresh venv's pip needs to install wheels offline.
"$PY" -m pip download --quiet --only-binary :all: --dest "$OUT" pip setuptools wheel
echo "wheelhouse: $OUT ($(find "$OUT" -name '*.whl' | wc -l) wheels, $(du -sh "$OUT" | cut -f1))" >&2
