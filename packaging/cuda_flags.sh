#!/usr/bin/env bash
# Print the CMake flags that add CUDA to the llama.cpp build, or nothing for a CPU build
# (packaging/cpu_flags.sh prints the CPU part; bootstrap.sh appends these to it).
#
#   * auto (TANDEM_CUDA unset or empty): CUDA when nvidia-smi lists a GPU and a CUDA
#     compiler (nvcc) is present; otherwise nothing, as on every CPU machine. An NVIDIA GPU
#     without a toolkit gets a note on stderr, and the CPU build;
#   * TANDEM_CUDA=0: never; TANDEM_CUDA=1: always, and a clear one-line error (exit 1)
#     when there is no nvcc or no architecture to build for;
#   * built for this machine's GPU architectures only (nvidia-smi --query-gpu=compute_cap,
#     "8.9" -> 89-real: no PTX for other cards, a smaller wheel and a shorter build), or
#     for TANDEM_CUDA_ARCH (e.g. "89" or "86;89") to build for a card that is not here;
#   * flash attention kernels on (GGML_CUDA_FA=ON): a quantized V cache needs them.
#     TANDEM_CUDA_FA=0 leaves them out for a shorter build (a quantized V cache then
#     computes attention on the CPU: slower, same results);
#   * NCCL off (GGML_CUDA_NCCL=OFF): one process drives one machine's cards here.
#
# nvcc is looked up on PATH, then as $CUDACXX, then in $CUDA_HOME/bin (default /usr/local/cuda).
# Usage: bash packaging/cuda_flags.sh
set -euo pipefail
want="${TANDEM_CUDA:-}"
case "$want" in
    ""|auto|0|1) ;;
    *) echo "error: TANDEM_CUDA must be 0, 1 or unset (auto), not '$want'" >&2; exit 1 ;;
esac
[ "$want" = 0 ] && exit 0

nvcc=$(command -v nvcc 2>/dev/null || true)
[ -z "$nvcc" ] && [ -n "${CUDACXX:-}" ] && [ -x "$CUDACXX" ] && nvcc=$CUDACXX
cuda_home="${CUDA_HOME:-${CUDA_PATH:-/usr/local/cuda}}"
[ -z "$nvcc" ] && [ -x "$cuda_home/bin/nvcc" ] && nvcc="$cuda_home/bin/nvcc"

# Compute capabilities of the GPUs here, "8.9" -> "89", one per architecture.
caps=""
if command -v nvidia-smi >/dev/null 2>&1; then
    caps=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null \
        | tr -d ' .\r' | grep -E '^[0-9]+$' | sort -un | tr '\n' ' ' || true)
fi
archs="${TANDEM_CUDA_ARCH:-}"
if [ -z "$archs" ] && [ -n "$caps" ]; then
    archs=$(for c in $caps; do printf '%s-real;' "$c"; done)
    archs=${archs%;}
fi

if [ -z "$want" ]; then
    [ -z "$caps" ] && exit 0  # no NVIDIA GPU here: the CPU build, exactly as before
    if [ -z "$nvcc" ]; then
        echo "note: an NVIDIA GPU is here but no CUDA toolkit (nvcc): llama.cpp is built for the CPU;" \
             "install the CUDA toolkit and run setup again to offload to the GPU" >&2
        exit 0
    fi
fi
if [ -z "$nvcc" ]; then
    echo "error: TANDEM_CUDA=1 but no CUDA compiler (nvcc) was found on PATH, in \$CUDACXX or in $cuda_home/bin: install the CUDA toolkit" >&2
    exit 1
fi
if [ -z "$archs" ]; then
    echo "error: TANDEM_CUDA=1 but nvidia-smi lists no GPU to build for: set TANDEM_CUDA_ARCH (e.g. 89) to build for a card that is not here" >&2
    exit 1
fi
fa=ON
case "${TANDEM_CUDA_FA:-1}" in
    1) ;;
    0) fa=OFF ;;
    *) echo "error: TANDEM_CUDA_FA must be 0 or 1, not '${TANDEM_CUDA_FA}'" >&2; exit 1 ;;
esac
flags="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$archs -DGGML_CUDA_FA=$fa -DGGML_CUDA_NCCL=OFF"
[ "$(command -v nvcc 2>/dev/null || true)" = "$nvcc" ] || flags="$flags -DCMAKE_CUDA_COMPILER=$nvcc"
echo "$flags"
