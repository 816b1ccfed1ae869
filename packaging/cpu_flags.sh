#!/usr/bin/env bash
# Print the CMake flags that build llama.cpp for the x86-64 CPU this runs on, portably:
#
#   * GGML_NATIVE=OFF, with each instruction-set option chosen from the CPU's own flags, so
#     an AVX2-only CPU never gets AVX-512 code and an AVX-512 CPU keeps its fast paths;
#   * AMX always OFF: llama.cpp's AMX matmul segfaults on real quantized models
#     (ggml-org/llama.cpp#20824), and GGML_NATIVE would compile it in on AMX CPUs;
#   * GGML_LLAMAFILE=OFF: llamafile's sgemm computes a short verify batch differently
#     from one-token decode steps, which breaks greedy identity of speculative decoding
#     (see runtime/backends/llama.py, "exact verification");
#   * GGML_RPC=ON on every kind of machine: llama.cpp's RPC backend, so a target can be
#     split over other machines running `tandem rpc-server` (runtime/backends/rpc.py).
#
# Usage: bash packaging/cpu_flags.sh [CPUINFO_FILE]   (default /proc/cpuinfo)
# Other architectures (arm64, macOS) get GGML_NATIVE=ON: none of these problems apply there.
set -euo pipefail
CPUINFO="${1:-/proc/cpuinfo}"
COMMON="-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DGGML_LLAMAFILE=OFF -DGGML_RPC=ON"
if [ "$(uname -m)" != "x86_64" ] || [ ! -r "$CPUINFO" ]; then
    echo "$COMMON -DGGML_NATIVE=ON"
    exit 0
fi
flags=" $(grep -m1 '^flags' "$CPUINFO" | cut -d: -f2) "
has() { case "$flags" in *" $1 "*) echo ON ;; *) echo OFF ;; esac; }
echo "$COMMON -DGGML_NATIVE=OFF" \
    "-DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma) -DGGML_F16C=$(has f16c)" \
    "-DGGML_BMI2=$(has bmi2) -DGGML_AVX_VNNI=$(has avx_vnni)" \
    "-DGGML_AVX512=$(has avx512f) -DGGML_AVX512_VBMI=$(has avx512vbmi)" \
    "-DGGML_AVX512_VNNI=$(has avx512_vnni) -DGGML_AVX512_BF16=$(has avx512_bf16)" \
    "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
