"""Measured constants of each backend kind for the memory model (split out of
:mod:`tandem.runtime.planning.memory_model`, which re-exports these names). Each constant says
where it was measured; the arithmetic that uses them is in the memory model."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RuntimeCosts:
    """Measured constants of one backend kind (bytes; coefficients per unit named)."""

    process: int
    """Once per process: runtime initialisation (thread pool, backend registry)."""
    per_model: int
    per_vocab: float
    """Vocabulary tables, per token of the vocabulary."""
    kt_flash: float
    """Compute bytes per (context cell × batch token) with flash attention: llama.cpp's
    f16 KQ mask, filled for every ubatch (2 bytes)."""
    kt_plain: float
    kth_plain: float
    """Score-matrix bytes per (context × batch × head) without flash attention."""
    t_embd: float
    """Activation bytes per (batch token × hidden width)."""
    out_row: float
    """Bytes per logits row element (llama.cpp output buffer + graph result + our copy)."""
    device_context: int = 0
    """Once per process on a CUDA device: context, cuBLAS workspace."""
    k_flash: float = 0.0
    """Bytes per context cell with flash attention beyond the KV cache itself (fitted)."""
    t_embd_flash: float = 0.0
    """Activation bytes per (batch token × hidden width) with flash attention (fitted)."""
    t_chunked: float = 0.0
    """Bytes per batch token once a context holds more than one batch (fitted): the
    second and later ubatches of a prefill touch a further ~4 kB per token of graph
    memory that a single-ubatch context never does."""
    per_model_next: float | None = None
    """``per_model`` for a model loaded into a process that already runs one of this
    kind (a drafter next to its target): the backend registry, CPU backend and thread
    pool set up with the first model are shared. ``None``: same as ``per_model``."""

    def model_runtime(self, n_vocab: int, first_in_process: bool = True) -> int:
        """Per-model runtime and vocabulary bytes (see ``per_model_next``)."""
        base = self.per_model if first_in_process or self.per_model_next is None else self.per_model_next
        return int(base + self.per_vocab * n_vocab)


LLAMA_CPP = RuntimeCosts(process=0, per_model=2_200_000, per_vocab=192.5, kt_flash=2.0,
                         kt_plain=7.14, kth_plain=5.54, t_embd=27.8, out_row=11.55,
                         device_context=350 * 1024**2, k_flash=145.0, t_embd_flash=47.5, t_chunked=4132.0,
                         per_model_next=1_860_000)
"""llama.cpp (CPU build; fitted, see :mod:`tandem.runtime.planning.memory_model`).

Flash attention (the planner's default) was refitted on 31 memprobe points (stories260K,
its 8M Q8_0 twin and tinystories-656k F32; contexts 256-4096, batches 8-512; max error
7.9 %): llama.cpp logs its flash compute buffer as exactly ``2·cells·batch`` (the f16
mask) plus ~3 kB per batch token, and the old fit's 6.91 bytes per cell × token (fitted
on contexts up to 2048, with vocab-32000 models) over-predicted long contexts by 14-47 %
(stories260K at 2304 cells × 256: +14 %, the SpecMemo drafter). The rest of the flash
compute is a per-cell term (``k_flash``), activations (``t_embd_flash``) and
``t_chunked``. The non-flash constants are the earlier fit. ``process`` is 0: what llama.cpp
adds once per process is shared-library code, which :mod:`tandem.runtime.planning.memprobe` no
longer counts (its resident size depends on the page cache, not the model).
``device_context`` is the usual CUDA context + cuBLAS handle size (~300-400 MiB), an
estimate not measured here.

``per_model_next`` (1.86 MB, against ``per_model``'s 2.2 MB) is a drafter's runtime next
to a loaded target: fitted (least squares on relative error) to what a drafter context
adds to a fresh process already holding its target (memprobe; targets: the 60M and 200M
Q8_0 twins of stories260K; drafters stories260K F32, its Q8_0 copy, tinystories-656k F32;
windows 128/256/1024 at batches 8/64, 1024 and 2040 at batch 256: 24 points, max error
4.5 %). The same drafter measured alone costs 0.14-0.43 MB more (median 0.2 MB): what
the first model pays for backend and thread-pool setup, which a second one shares. Measured
per-point, the runtime term of a second model ranges 1.70-2.15 MB; the spread is in the
compute terms (small windows at batch 64 over-predicted by ~0.15 MB, the 2304-cell
context under-predicted by ~0.2 MB), not in the runtime."""

TORCH_CUDA_HOST = 300 * 1024**2
"""Host RSS that torch's CUDA runtime adds once a drafter runs on the GPU (context,
driver mappings, cuBLAS). Measured 272 MiB on an H100 with torch 2.11+cu130 (133 MiB at
context creation, 139 MiB at the first matmul); other drivers differ, so it is a named
constant for a measurement to replace. Only the first CUDA user of a process pays it;
planning on a detected GPU has already created the context (free VRAM is asked of
CUDA), and then the baseline holds :data:`TORCH_CUDA_HOST_CONTEXT` of it already."""
TORCH_CUDA_HOST_CONTEXT = 133 * 1024**2
"""The share of :data:`TORCH_CUDA_HOST` paid when the CUDA context is created (measured
133 MiB on that H100); the rest comes with the first kernels and cuBLAS."""
TORCH_CUDA_DEVICE = 720 * 1024**2
"""VRAM the CUDA context and cuBLAS workspace take outside torch's allocator: 0.7 GiB
measured on that H100 (free memory before and after); smaller GPUs typically need
300-500 MiB, so this errs large."""
TORCH_ALLOC_ROUND = 512
"""The CUDA caching allocator rounds every block up to this many bytes."""
TORCH_SCORE_MATRICES = 2.5
"""Float32 (heads × chunk × keys) matrices alive at once in attention: the torch engine
passes SDPA an explicit mask, which sends it to the unfused math path (scores, masked
scores, softmax; measured 2.5-2.9 on an H100 for chunks of 64-512 tokens)."""
TORCH_WORK_FIXED = 64 * 1024
"""Small blocks of a forward pass (rope tables, positions, index tensors), each rounded."""

TORCH = RuntimeCosts(process=0, per_model=500_000, per_vocab=1600.0, kt_flash=0.0, kt_plain=5.0,
                     kth_plain=8.0, t_embd=78.0, out_row=8.0, device_context=TORCH_CUDA_DEVICE)
"""torch engine on the CPU (fitted to memprobe peaks with glibc's mmap threshold pinned,
see ``torch_engine.backend.return_large_temporaries``: stories260K and tinystories-656k
F32, contexts 256-2048, batches 64-512, 16 points; -10 % to +11 %, most within 7 %;
``per_model`` lowered from 1.69 MB to 0.5 MB after two machines, AMD and CI's, measured the
tested points 5-14 % under: now -2 % to +9 % against the nearest of three runs).
``import torch`` (~250-350 MB) is in the process baseline, not here. The engine hands
SDPA 3-D tensors and a boolean mask, which takes the unfused math path: per chunk of
``t`` tokens over ``S`` keys it holds two float32 score matrices per head (scores, then
softmax: ``kth_plain`` 8 bytes per key × token × head) and the mask as bool and as
float32 (``kt_plain`` 5 bytes per key × token); these are arithmetic, not fitted.
Fitted: ``per_model`` and ``per_vocab`` (tokenizer tables are Python objects: ~2.4 kB a
token at the load step, 1.6 kB fits the peaks — the 656k model, with 4x the vocabulary,
was over-predicted by 6-12 % with 2.4 kB), ``t_embd`` (activations, ~20 float32 per hidden unit per
chunk token) and :data:`TORCH_HEAP_RETAINED`. The flash fields are unused."""
TORCH_HEAP_RETAINED = 5.07
"""Heap bytes the torch engine keeps resident per byte of its final KV cache (fitted):
blocks under the mmap threshold (the doubling cache's old generations, masks, per-layer
K/V expansions) are freed into glibc's heap, which does not shrink below live blocks."""

ONNX = RuntimeCosts(process=0, per_model=3_300_000, per_vocab=0.0, kt_flash=0.0, kt_plain=0.0,
                    kth_plain=20.2, t_embd=0.0, out_row=8.0, device_context=500 * 1024**2)
"""onnxruntime, CPU execution provider (fitted to memprobe peaks of ``tandem export-onnx``
graphs of stories260K and tinystories-656k, contexts 256-2048, batches 64-512; -4 % to
+4 %). ``import onnxruntime`` is in the process baseline, so ``process`` is 0. The
exported graph computes attention explicitly: 20.2 bytes per (key × batch token × head)
is ~5 float32 score-sized buffers that the CPU arena keeps at their peak (it does not
give freed blocks back); the session and arena setup is ``per_model`` (3.3 MB, a
measured constant). Six copies of the context's KV live during a step (past inputs,
present outputs, the graph's concatenations, our numpy list): counted in the memory
model's ``_kv``. There is no flash path; the flash fields are unused. ``device_context``
is an unmeasured estimate."""

COSTS = {"llama.cpp": LLAMA_CPP, "torch": TORCH, "onnxruntime": ONNX}
