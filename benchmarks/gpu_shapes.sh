#!/usr/bin/env bash
# On the GPU machine, before the kit's build (in parallel with it): write the 7B dense and the
# Qwen3-30B-A3B MoE real-shape models (random Q4_K_M-like blocks, benchmarks/gpu_shapes.py) into
# $SHAPES (default /tmp/shapes), each marked complete by NAME.gguf.done. Needs numpy only: gguf
# is read from the kit's wheel. Log: /tmp/shapes.log.
S=${SHAPES:-/tmp/shapes}; mkdir -p "$S"
W=$(ls .gpu-kit/whl/gguf-*.whl | head -1)
{
for name in qwen2.5-7b qwen3-30b-a3b; do
    [ -f "$S/$name.gguf.done" ] && continue
    PYTHONPATH=$W python3 -m benchmarks.gpu_shapes "$name" "$S/$name.gguf" --vocab-from .gpu-kit/skel/qwen2.5-coder-1.5b.gguf && touch "$S/$name.gguf.done"
done
} >> /tmp/shapes.log 2>&1
