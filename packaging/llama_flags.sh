#!/usr/bin/env bash
# Print the CMake flags bootstrap.sh builds llama.cpp with: this CPU's (cpu_flags.sh) and,
# where an NVIDIA GPU and a CUDA toolkit are (or TANDEM_CUDA=1), CUDA's (cuda_flags.sh).
# A CPU machine gets exactly cpu_flags.sh's line. Fails (exit 1, one line on stderr) when
# TANDEM_CUDA=1 cannot be honoured.
# Usage: bash packaging/llama_flags.sh [CPUINFO_FILE]
set -euo pipefail
here=$(dirname "$0")
cpu=$(bash "$here/cpu_flags.sh" "$@")
cuda=$(bash "$here/cuda_flags.sh")
echo "$cpu${cuda:+ $cuda}"
