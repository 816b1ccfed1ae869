#!/usr/bin/env bash
# A second call on a GPU machine still warm from `.gpu-kit/on-device.sh`: its CUDA llama.cpp and
# models under /tmp/kit are still there, so COMMAND runs at once with the same environment. On a
# fresh machine this falls back to the kit's whole run (about 4 minutes of building first).
#   bash benchmarks/gpu_again.sh 'bash benchmarks/gpu_check.sh speed'
set -u
K=$PWD/.gpu-kit
if [ ! -d /tmp/kit/cuda/llama_cpp ] || [ ! -f /tmp/kit/models/qwen2.5-coder-1.5b.gguf ]; then
    echo "[again] no warm kit here: the whole kit run"; exec bash "$K/on-device.sh" "$@"
fi
mkdir -p /tmp/kit/tandem/tandem; for d in app runtime kernels models; do ln -sfn "$PWD/$d" /tmp/kit/tandem/tandem/$d; done
export KIT_MODELS=/tmp/kit/models CPU_PYTHONPATH=/tmp/kit/site:/tmp/kit/tandem:$K/cpu
export PYTHONPATH=/tmp/kit/site:/tmp/kit/tandem:/tmp/kit/cuda TANDEM_HOME=/tmp/kit/home TANDEM_FIXTURES=$K/fixtures
export PYTHONUNBUFFERED=1
echo "[again] warm kit found: running $*"; bash -c "$*"
