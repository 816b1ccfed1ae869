"""The words each engine setting may take: draft modes, engines, KV cache types,
placements, offload pins, suffix-tree memories. One definition each, for the flags that
offer them (``tandem run --draft-mode``...), the :class:`~tandem.runtime.engine.spec.EngineSpec`
that holds them, and the parts that act on them.

It imports nothing: the command line builds its parser from it before the runtime
(numpy, llama.cpp) is loaded, and every part of the runtime may use it."""

from __future__ import annotations

from typing import Literal, get_args

ENGINES = ("auto", "llama.cpp", "torch")
"""``--engine``: where the target runs. ``auto``: by file type (GGUF: llama.cpp, a
Hugging Face folder: the torch engine, an ONNX export: onnxruntime)."""
LLAMA_KV_TYPES = ("f16", "q8_0", "q4_0")
"""``--kv-type`` for llama.cpp targets, best first: the planner tries them in this order
(a quantized one only when f16 does not fit; ``--kv-type`` fixes one)."""
MODES = ("auto", "model", "xvocab", "ngram", "off")
"""Draft modes (``--draft-mode``); see :func:`tandem.runtime.speculative.factory.build_strategy`."""
DEVICE_CHOICES = ("auto", "gpu", "cpu", "target-gpu")
"""``--placement``: measured choice, drafter on the GPU, drafter on the CPU (target on
CPU threads either way), or target on the GPU with the drafter on the CPU
(:mod:`tandem.runtime.planning.placement`)."""
OFFLOAD_CHOICES = ("a", "b", *(f"c-{kv}" for kv in LLAMA_KV_TYPES[1:]))
"""What ``--offload`` may pin (:attr:`tandem.runtime.planning.plan.OffloadOption.pin`): ``a``
partial offload, ``b`` the target on CPU threads, ``c-q8_0``/``c-q4_0`` partial offload with
that KV cache."""
SuffixMemory = Literal["request", "process", "saved"]
"""What the suffix-tree drafter learns from: the current request only; every earlier
request in the process too; or those and the earlier sessions' (kept on disk)."""
SUFFIX_MEMORIES: tuple[SuffixMemory, ...] = get_args(SuffixMemory)
