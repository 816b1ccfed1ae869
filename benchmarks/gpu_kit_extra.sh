#!/usr/bin/env bash
# After `bash ../shared/gpu/make-kit.sh`: what Tandem needs on the GPU machine beyond the kit,
# within the 64 MiB a run may carry. Adds the wheels the device image lacks (llguidance for
# structured output, jsonschema for its tests, Textual's markdown plugins) and drops the
# tokenizer fixtures no GPU check reads (12 MB). Needs the network (the package index), here.
#   bash ../shared/gpu/make-kit.sh && bash benchmarks/gpu_kit_extra.sh
set -euo pipefail
cd "$(dirname "$0")/.."
W=.gpu-kit/whl
[ -d "$W" ] || { echo "no .gpu-kit here: run bash ../shared/gpu/make-kit.sh first" >&2; exit 1; }
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_31_x86_64 -d "$W" \
    "llguidance>=1.9,<2" jsonschema jsonschema-specifications referencing rpds-py \
    mdit-py-plugins linkify-it-py uc-micro-py
rm -rf .gpu-kit/fixtures/tokenizers
du -sh .gpu-kit
