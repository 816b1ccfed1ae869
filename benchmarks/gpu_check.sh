#!/usr/bin/env bash
# Every GPU check of llama.cpp on CUDA in one run on a GPU machine, after the kit has built
# CUDA llama.cpp and the real-shape models (../shared/gpu/README.md):
#
#   bash .gpu-kit/on-device.sh 'bash benchmarks/gpu_check.sh'
#
# In order of what matters most if time runs out: the build and the card, the self-check,
# the crash bisection (which setting makes a CUDA build die), the GPU test tier and the
# four planner tests that failed there, `tandem plan/run/serve/bench` on the kit's models,
# predicted against allocated VRAM (benchmarks/gpu_vram.py), the peer's own timings.
# Each step has a time limit; every log goes under $OUT; a table of steps ends the output.
set -u
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONFAULTHANDLER=1  # a native crash prints the Python frame it happened under
M=${KIT_MODELS:?run this through .gpu-kit/on-device.sh (it sets KIT_MODELS)}
T=$M/qwen2.5-coder-1.5b.gguf
D=$M/qwen2.5-coder-0.5b.gguf
CLI=(python3 -m tandem.app.cli)
T0=$(date +%s)
: > "$OUT/steps.txt"

step() {  # step NAME LIMIT_S COMMAND...: run, log to $OUT/NAME.log, record rc and seconds
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    printf '%-28s rc=%-4s %4ss  (t=%ss)\n' "$name" "$rc" "$(( $(date +%s) - start ))" "$(( $(date +%s) - T0 ))" \
        | tee -a "$OUT/steps.txt"
}

nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,compute_cap --format=csv > "$OUT/card.csv" 2>&1
step build 60 python3 -c '
import llama_cpp
from tandem.runtime.backends.llama_devices import gpu_offload_build, list_devices
print(llama_cpp.llama_print_system_info().decode())
print("registry:", list_devices(memory=True))
print("offloads:", gpu_offload_build(), " llama_supports_gpu_offload:", bool(llama_cpp.llama_supports_gpu_offload()))'
step selfcheck 240 python3 -m tandem.runtime.backends.selfcheck
step baseline 240 python3 -c '
from tandem.runtime.planning.baseline import machine_baseline
print(machine_baseline())  # llama_context: host bytes per model, measured with a tiny CPU model on this build'
step crash_bisect 600 python3 -m benchmarks.gpu_crash_bisect "$T" --out "$OUT" --timeout 120
step gpu_tier 600 python3 -m pytest -q -rs -p no:cacheprovider tests/runtime/backends/test_llama_gpu.py \
    tests/app/server/test_infill_gpu.py tests/runtime/backends/test_llama_devices.py tests/runtime/planning/test_gpu_offload.py
step once_failing 400 python3 -m pytest -q -rs -p no:cacheprovider \
    tests/runtime/planning/test_placement.py::test_target_on_gpu_needs_a_cuda_gpu_and_room \
    tests/runtime/speculative/test_gpu_split.py::test_placement_through_the_planner_is_lossless
step plan 120 "${CLI[@]}" plan -m "$T" --draft "$D"
step plan_small_vram 120 "${CLI[@]}" plan -m "$T" --vram 700MiB
for mode in off ngram; do
    step "run_$mode" 180 "${CLI[@]}" run -m "$T" -p "def quicksort(items):" -n 96 --raw --json --draft-mode "$mode"
done
step run_model 180 "${CLI[@]}" run -m "$T" --draft "$D" -p "def quicksort(items):" -n 96 --raw --json --draft-mode model
step run_kv_q4_0 180 "${CLI[@]}" run -m "$T" -p "def quicksort(items):" -n 64 --raw --json --kv-type q4_0
step vram 600 python3 -m benchmarks.gpu_vram --target "$T" --draft "$D" --out "$OUT"
step serve 240 bash -c '
port=18080
python3 -m tandem.app.cli serve -m "$1" --port $port > "$2/serve.server.log" 2>&1 & pid=$!
trap "kill $pid 2>/dev/null; wait $pid 2>/dev/null" EXIT
python3 - $port <<EOF
import json, sys, time, urllib.request
url = f"http://127.0.0.1:{sys.argv[1]}"
def post(path, body):
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=120).read())
for _ in range(240):
    try:
        urllib.request.urlopen(url + "/v1/models", timeout=2); break
    except OSError:
        time.sleep(0.5)
chat = post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "temperature": 0})
fill = post("/infill", {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n", "n_predict": 16})
print("chat:", json.dumps(chat)[:400]); print("infill:", json.dumps(fill)[:400])
EOF' serve "$T" "$OUT"
step bench 420 "${CLI[@]}" bench -m "$T" --draft "$D" -n 64 --workloads edit,codegen --prompts 1 --reps 1 \
    --configs plain,ngram,auto+model --json "$OUT/bench.json"
[ -f .gpu-kit/ck.py ] && step peer_ck 180 python3 .gpu-kit/ck.py "$T" 99 "$(nproc)"

echo
echo "== steps (logs in $OUT) =="
cat "$OUT/steps.txt"
echo "== crash bisection =="
grep -v '^$' "$OUT/crash_bisect.log" | tail -30
echo "== GPU tier =="
tail -15 "$OUT/gpu_tier.log"
echo "== VRAM =="
cat "$OUT/vram.log" | tail -10
