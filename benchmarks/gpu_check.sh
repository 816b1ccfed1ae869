#!/usr/bin/env bash
# Every GPU check of llama.cpp on CUDA in prepared runs on a GPU machine, after the kit has built
# CUDA llama.cpp and the real-shape models (../shared/gpu/README.md). Larger real shapes (7B dense,
# Qwen3-30B-A3B MoE) are written there by benchmarks/gpu_shapes.py, started before the kit's build:
#
#   export RUN_T0=$(date +%s); bash benchmarks/gpu_shapes.sh &
#   bash .gpu-kit/on-device.sh 'bash benchmarks/gpu_check.sh runs fit'     # issue 25 (first call)
#   bash benchmarks/gpu_again.sh 'bash benchmarks/gpu_check.sh speed'      # issue 26 (warm machine)
#
# Phases: runs: what crashes and what runs (crash bisection, self-check, the GPU test tier, the
# planner tests that failed there, `tandem plan/run/serve/bench`), all at once since they look for
# failures, not timings; fit: predicted against allocated VRAM (alone on the card); speed: costs
# and tok/s (alone, one after another). Each step has a time limit, cut to what is left before
# $RUN_T0 + $RUN_LIMIT; every log goes under $LOGS, packed into $OUT/logs.tar.gz at the end (a
# device run brings back at most 8 files); a table of steps and the key logs' tails end the output.
set -u
OUT=${OUT:-/tmp/gpu-check}
LOGS=/tmp/gpu-logs/$(date +%s)
mkdir -p "$OUT" "$LOGS"
export PYTHONFAULTHANDLER=1  # a native crash prints the Python frame it happened under
M=${KIT_MODELS:?run this through .gpu-kit/on-device.sh (it sets KIT_MODELS)}
T=$M/qwen2.5-coder-1.5b.gguf
D=$M/qwen2.5-coder-0.5b.gguf
S=${SHAPES:-/tmp/shapes}
CLI=(python3 -m tandem.app.cli)
T0=$(date +%s)
END=$(( ${RUN_T0:-$T0} + ${RUN_LIMIT:-570} ))
touch "$LOGS/steps.txt"

left() { echo $(( END - $(date +%s) )); }

STATE=/tmp/gpu-state  # steps already run on this (warm) machine: a second call skips them
mkdir -p "$STATE"

step() {  # step NAME LIMIT_S COMMAND...: run, log to $LOGS/NAME.log, record rc and seconds
    local name=$1 limit=$2 start rc
    shift 2
    if [ -f "$STATE/$name" ]; then
        printf '%-28s done in an earlier call: %s\n' "$name" "$(cat "$STATE/$name")" | tee -a "$LOGS/steps.txt"; return
    fi
    (( limit > $(left) )) && limit=$(left)
    if (( limit < 8 )); then
        printf '%-28s skipped (no time left)\n' "$name" | tee -a "$LOGS/steps.txt"; return
    fi
    start=$(date +%s)
    timeout -k 5 "$limit" "$@" > "$LOGS/$name.log" 2>&1
    rc=$?
    (( rc != 124 && rc != 137 )) && echo "rc=$rc" > "$STATE/$name"  # a step cut short runs again next call
    printf '%-28s rc=%-4s %4ss  (t=%ss)\n' "$name" "$rc" "$(( $(date +%s) - start ))" "$(( $(date +%s) - T0 ))" \
        | tee -a "$LOGS/steps.txt"
}

wait_shape() {  # wait_shape NAME: the model benchmarks/gpu_shapes.sh writes, once complete (at most 60 s)
    local f=$S/$1.gguf until=$(( $(date +%s) + 60 ))
    while [ ! -f "$f.done" ] && (( $(left) > 20 && $(date +%s) < until )); do sleep 2; done
    [ -f "$f.done" ] && echo "$f"
}

runs() {
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,compute_cap --format=csv > "$LOGS/card.csv" 2>&1
    tail -3 /tmp/kit/build.log > "$LOGS/build_tail.log" 2>/dev/null
    step build 60 python3 -c '
import llama_cpp
from tandem.runtime.backends.llama_devices import gpu_offload_build, list_devices
print(llama_cpp.llama_print_system_info().decode())
print("registry:", list_devices(memory=True))
print("offloads:", gpu_offload_build(), " llama_supports_gpu_offload:", bool(llama_cpp.llama_supports_gpu_offload()))'
    # Everything below looks for crashes and wrong results, not timings: all at once.
    step crash_bisect 100 python3 -m benchmarks.gpu_crash_bisect "$T" --out "$LOGS" --timeout 60 ${BISECT:-} &
    step selfcheck 150 python3 -m tandem.runtime.backends.selfcheck &
    step baseline 150 python3 -c '
from tandem.runtime.planning.baseline import machine_baseline
print(machine_baseline())' &
    step gpu_tier 200 python3 -m pytest -q -rs -p no:cacheprovider -o addopts="" tests/runtime/backends/test_llama_gpu.py \
        tests/app/server/test_infill_gpu.py tests/runtime/backends/test_llama_devices.py tests/runtime/planning/test_gpu_offload.py &
    step once_failing 200 python3 -m pytest -q -rs -p no:cacheprovider -o addopts="" \
        tests/runtime/planning/test_placement.py::test_target_on_gpu_needs_a_cuda_gpu_and_room \
        "tests/runtime/speculative/test_gpu_split.py::test_placement_through_the_planner_is_lossless" &
    step plan 60 "${CLI[@]}" plan -m "$T" --draft "$D" &
    step plan_small_vram 60 "${CLI[@]}" plan -m "$T" --vram 700MiB &
    step run_off 120 "${CLI[@]}" run -m "$T" -p "def quicksort(items):" -n 96 --raw --json --draft-mode off &
    step run_ngram 120 "${CLI[@]}" run -m "$T" -p "def quicksort(items):" -n 96 --raw --json --draft-mode ngram &
    step run_model 120 "${CLI[@]}" run -m "$T" --draft "$D" -p "def quicksort(items):" -n 96 --raw --json --draft-mode model &
    step run_kv_q8_0 120 "${CLI[@]}" run -m "$T" -p "def quicksort(items):" -n 64 --raw --json --kv-type q8_0 &
    step serve 150 bash -c '
port=18080
python3 -m tandem.app.cli serve -m "$1" --port $port > "$2/serve_server.log" 2>&1 & pid=$!
trap "kill $pid 2>/dev/null; wait $pid 2>/dev/null" EXIT
python3 - $port <<EOF
import json, sys, time, urllib.request
url = f"http://127.0.0.1:{sys.argv[1]}"
def post(path, body):
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=120).read())
for _ in range(240):
    try:
        urllib.request.urlopen(url + "/health", timeout=2); break
    except OSError:
        time.sleep(0.5)
chat = post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "temperature": 0})
fill = post("/infill", {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n", "n_predict": 16})
print("chat:", json.dumps(chat)[:400]); print("infill:", json.dumps(fill)[:400])
EOF' serve "$T" "$LOGS" &
    step bench 150 "${CLI[@]}" bench -m "$T" --draft "$D" -n 48 --workloads edit --prompts 1 --reps 1 \
        --configs plain,ngram,auto+model --json "$LOGS/bench.json" &
    wait
}

fit() {
    step vram 150 python3 -m benchmarks.gpu_vram --target "$T" --draft "$D" --out "$LOGS" --timeout 60
    local big
    big=$(wait_shape qwen2.5-7b) && step plan_7b_3gib 60 "${CLI[@]}" plan -m "$big" --draft "$D" --vram 3GiB
}

speed() {
    local big moe
    step costs_15b 60 python3 -m benchmarks.gpu_costs "$T" --ngl -1 --peer
    step costs_05b 40 python3 -m benchmarks.gpu_costs "$D" --ngl -1 --ks 1 --peer
    step bench_gpu 150 "${CLI[@]}" bench --gpu -m "$T" --draft "$D" --acceptance benchmarks/figures/acceptance-qwen-coder.json \
        --json "$LOGS/bench_gpu.json" --plot "$OUT/bench_gpu.png"
    if big=$(wait_shape qwen2.5-7b); then
        step costs_7b_gpu 60 python3 -m benchmarks.gpu_costs "$big" --ngl -1 --peer
        # bigger than the card: a 3 GiB budget (the planner's layers), the target on CPU threads
        local ngl
        ngl=$(python3 -c '
import json, subprocess, sys
out = subprocess.run([sys.executable, "-m", "tandem.app.cli", "plan", "-m", sys.argv[1], "--vram", "3GiB", "--json"],
                     capture_output=True, text=True).stdout
print(json.loads(out)["target"]["n_gpu_layers"])' "$big" 2>/dev/null || echo 12)
        step costs_7b_3gib 90 python3 -m benchmarks.gpu_costs "$big" --ngl "$ngl,0" --ks 1,2,3,4,6,8 --reps 5 --peer
        # the placements the planner compares at 3 GiB (partial offload, target on CPU threads, quantized KV),
        # each timed against llama-cpp-python's partial offload at that budget, plus sections 1-4 on the 7B
        step bench_7b_3gib 300 "${CLI[@]}" bench --gpu -m "$big" --draft "$D" --vram 3GiB -n 32 --prompts 1 --reps 2 \
            --acceptance benchmarks/figures/acceptance-qwen-coder.json --json "$LOGS/bench_7b_3gib.json"
    fi
    # issue 27: the 16-core host's CPU (this build's CPU llama.cpp): exact, repacked and the peer at 8 threads
    step cpu_kernels_8t 90 env PYTHONPATH="$CPU_PYTHONPATH" python3 -m benchmarks.kernels "$T" --threads 8 \
        --prompt 480 --steps 24 --rounds 3
    # ... and the verify-cost curve c(k) with the weights as stored (Tandem's exact calls of up to 7 tokens)
    # against the fast configuration, and the 0.5B drafter's cost: what the 8-thread model of drafts uses
    step cpu_costs_8t 60 env PYTHONPATH="$CPU_PYTHONPATH" "${CLI[@]}" bench --cost-curve -m "$T" --draft "$D" --threads 8 --reps 5
    step cpu_costs_16t 60 env PYTHONPATH="$CPU_PYTHONPATH" "${CLI[@]}" bench --cost-curve -m "$T" --threads 16 --reps 5
    if moe=$(wait_shape qwen3-30b-a3b); then
        step plan_moe 60 "${CLI[@]}" plan -m "$moe" --moe-offload --vram 8GiB --ctx 256
        step moe 100 python3 -m benchmarks.gpu_moe "$moe" --vram 8GiB --out "$LOGS" --tokens 16 --rounds 3
    fi
    # issue 28: 4 parallel slots against one on the GPU, and the host's time per step beside llama_decode
    step slot_overhead 90 python3 -m benchmarks.slot_overhead "$D" --ngl -1 --slots 4 --tokens 128 --rounds 3
    step slot_overhead_spec 90 python3 -m benchmarks.slot_overhead "$D" --ngl -1 --slots 4 --tokens 128 --rounds 3 \
        --speculative
    # issue 28: 4 parallel slots against one worker on the GPU (plain decoding: no drafts to accept)
    step server_load 120 python3 -m benchmarks.server_load --model "$T" --threads 8 --parallel 4 --clients 4 \
        --seconds 10 --idle-infills 4 --rounds 1
}

for phase in "$@"; do "$phase"; done

cp /tmp/shapes.log "$LOGS/" 2>/dev/null
tar -czf "$OUT/logs.tar.gz" -C "$LOGS" .
echo
echo "== build =="; tail -2 /tmp/kit/build.log 2>/dev/null | cut -c1-400
echo "== steps (all logs in logs.tar.gz) =="
cat "$LOGS/steps.txt"
for f in crash_bisect gpu_tier once_failing vram plan_7b_3gib costs_15b costs_05b bench_gpu costs_7b_gpu costs_7b_3gib cpu_kernels_8t plan_moe moe server_load; do
    [ -f "$LOGS/$f.log" ] && { echo "== $f =="; grep -v '^$' "$LOGS/$f.log" | tail -${TAIL:-20} | cut -c1-300; }
done
exit 0
