#!/bin/bash
# Usage: T=2 N=64 bash benchmarks/suffix_sessions.sh   (real models from shared/fixtures/real-models.sh)
# Saved suffix tree: a second session re-asking the same prompt vs the first session, vs plain.
M=~/.cache/tandem-real-models; T=${T:-2}; N=${N:-64}
P="Write a Python function that parses an ISO 8601 date string (with an optional time zone) and returns a datetime. Include a docstring and two examples."
cd "$(dirname "$0")/.."
for rep in 1 2 3; do
  H=$(mktemp -d); mkdir -p $H/cache; cp ~/.cache/tandem/verify_cost.json $H/cache/ 2>/dev/null
  for mode in off first second; do
    dm=auto; [ $mode = off ] && dm=off
    TANDEM_HOME=$H HF_HUB_OFFLINE=1 .venv/bin/tandem run -m $M/qwen2.5-coder-1.5b.gguf -p "$P" -n $N --threads $T --draft-mode $dm --json 2>/dev/null \
      | python3 -c "import json,sys; d=json.load(sys.stdin); s=d['stats']; import hashlib; print('$rep', '$mode', round(s['tokens_per_s'],2), s['target_calls'], s['accepted_tokens'], s['drafted_tokens'], hashlib.md5(d['text'].encode()).hexdigest()[:8])"
  done
  rm -rf $H
done
