#!/usr/bin/env bash
# On a GPU machine with no network, from the project root, with the kit (../shared/gpu) carried
# along as .gpu-kit: build llama.cpp the way a user's setup does — packaging/llama_wheel.sh, its
# CUDA flags from packaging/cuda_flags.sh, offline from the kit's source archive — then run
# COMMAND with the environment of the kit's own on-device.sh (PYTHONPATH with Tandem from this
# tree and the new CUDA build, KIT_MODELS with the real-shape models it fills meanwhile,
# TANDEM_HOME, TANDEM_FIXTURES). This checks setup's CUDA path itself, not a copy of its flags.
#
#   bash benchmarks/gpu_device.sh 'bash benchmarks/gpu_check.sh runs fit speed'
#
# TANDEM_CUDA_FA=0 (the default here, to save build minutes; users build with it on) leaves out
# flash attention's kernels. The build's time and flags land in /tmp/kit/build.log.
set -u
K=$PWD/.gpu-kit
T0=$(date +%s)
export PYTHONUNBUFFERED=1
say() { echo "[device $(( $(date +%s) - T0 ))s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/kit/site "$K"/whl/*.whl 2>&1 | tail -1
mkdir -p /tmp/kit/tandem/tandem; for d in app runtime kernels models; do ln -sfn "$PWD/$d" /tmp/kit/tandem/tandem/$d; done
export KIT_MODELS=/tmp/kit/models; mkdir -p $KIT_MODELS
CPU_PATH=/tmp/kit/site:/tmp/kit/tandem:$K/cpu
(
    start=$(date +%s)
    export TANDEM_CUDA=1 TANDEM_CUDA_FA=${TANDEM_CUDA_FA:-0} CMAKE_BUILD_PARALLEL_LEVEL=15
    if ! bash packaging/llama_flags.sh > /dev/null 2> /tmp/kit/flags.err; then
        # setup's flags could not be made here (said in the log): the kit's own, so the run goes on
        echo "llama_flags.sh failed: $(cat /tmp/kit/flags.err); using the kit's flags" >> /tmp/kit/build.log.pre
        export CMAKE_ARGS="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)-real -DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DGGML_LLAMAFILE=OFF -DGGML_RPC=ON -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
    fi
    TANDEM_LLAMA_SDIST=$(ls "$K"/llama_cpp_python-*-slim.tar.gz) \
        bash packaging/llama_wheel.sh python3 > /tmp/kit/wheel_dir 2> /tmp/kit/build.log
    rc=$?
    cat /tmp/kit/build.log.pre >> /tmp/kit/build.log 2>/dev/null
    echo "flags: ${CMAKE_ARGS:-$(bash packaging/llama_flags.sh 2>&1)}" >> /tmp/kit/build.log
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/kit/cuda \
        "$(cat /tmp/kit/wheel_dir)"/llama_cpp_python-*.whl >> /tmp/kit/build.log 2>&1
    echo "build rc=$rc in $(( $(date +%s) - start )) s" >> /tmp/kit/build.log
) &
B=$!
( for n in qwen2.5-coder-1.5b:q4_k_m qwen2.5-coder-0.5b:q4_k_m smollm2-135m-instruct:q4_1; do
    m=${n%%:*}; [ -f "$K/skel/$m.gguf" ] || continue
    PYTHONPATH=$CPU_PATH python3 "$K/skeleton.py" fill "$K/skel/$m.gguf" /tmp/kit/$m.f16.gguf &&
    PYTHONPATH=$CPU_PATH python3 "$K/quant.py" /tmp/kit/$m.f16.gguf $KIT_MODELS/$m.gguf ${n##*:} 15 > /dev/null 2>&1
    rm -f /tmp/kit/$m.f16.gguf; done ) > /tmp/kit/models.log 2>&1 &
M=$!
wait $M; say "models: $(ls $KIT_MODELS | tr '\n' ' ')"
wait $B; say "$(tail -1 /tmp/kit/build.log)"; [ -d /tmp/kit/cuda/llama_cpp ] || tail -30 /tmp/kit/build.log
export CPU_PYTHONPATH=$CPU_PATH PYTHONPATH=/tmp/kit/site:/tmp/kit/tandem:/tmp/kit/cuda TANDEM_HOME=/tmp/kit/home
export TANDEM_FIXTURES=$K/fixtures
say "running: $*"; bash -c "$*"; rc=$?; say "done rc=$rc"; exit $rc
