#!/bin/bash
# Usage: T=2 bash benchmarks/first_run.sh   (real models from shared/fixtures/real-models.sh)
# What a new pair costs its first `tandem run`: wall time and first-token time of the
# first run vs the same command again, with (a) an empty cache dir (a machine never seen)
# and (b) a cache dir where another model already ran (a known machine, a new pair).
M=~/.cache/tandem-real-models; T=${T:-2}
cd "$(dirname "$0")/.."
run() {  # $1: TANDEM_HOME; prints wall seconds and ttft
  local start end
  start=$(date +%s.%N)
  TANDEM_HOME=$1 HF_HUB_OFFLINE=1 .venv/bin/tandem run -m $M/qwen2.5-coder-1.5b.gguf \
    --draft $M/qwen2.5-coder-0.5b.gguf -p "Explain what a mutex is." -n 16 --threads $T --json 2>/dev/null >$1/out.json
  end=$(date +%s.%N)
  python3 -c "import json; s=json.load(open('$1/out.json'))['stats']; print(f'{$end-$start:.2f} s wall, ttft {s[\"ttft_s\"]:.3f} s')"
}
for rep in 1 2 3; do
  for kind in new-machine known-machine; do
    H=$(mktemp -d)
    if [ $kind = known-machine ]; then
      TANDEM_HOME=$H HF_HUB_OFFLINE=1 .venv/bin/tandem run -m $M/smollm2-135m-instruct.gguf -p hi -n 4 --threads $T >/dev/null 2>&1
    fi
    echo "$rep $kind first: $(run $H)"
    echo "$rep $kind again: $(run $H)"
    rm -rf $H
  done
done
