"""How many bytes a target + drafter pair needs, per device, before anything is loaded.

Arithmetic over model shapes (read from GGUF headers or HF configs) and runtime
settings, so the planner can price options for this machine or for another one. What a
budget promises is the process's peak resident memory (RSS, as ``/usr/bin/time -f %M``
reports it); the planner adds the process baseline (:mod:`tandem.runtime.planning.baseline`).

A GGUF on the CPU (:func:`llama_cpu_items`) is priced from what llama.cpp itself
reports, not from constants fitted on one machine: the file it maps (weights used in
place), the KV cache (exact arithmetic), the compute buffer its scheduler reserves for
the context and the model's runtime heap (both read from llama.cpp in a child process
that loads metadata only, :mod:`tandem.runtime.planning.llama_sizes`), the logits rows, the CPU
matmul work buffer (an upper bound) and a per-context overhead measured once per
machine with a tiny model. On the real models this predicts `tandem run`'s peak within
-2 %/+3 % (tests/runtime/planning/test_memory_model.py, BENCHMARKS.md).

The older fitted terms (:mod:`tandem.runtime.planning.costs`) remain for what cannot be
asked of llama.cpp here: layers offloaded to a GPU, shapes without a file (a profile's
hypothetical quant), onnxruntime (``ONNX``) and the torch engine on the CPU (``TORCH``) or
on CUDA (:func:`torch_gpu_items`, fitted to ``torch.cuda.max_memory_allocated`` on an H100).
Speculation adds the verification logits rows (in the target's ``output_rows``), the
drafter's q rows and, for a growable cache (torch), the candidate KV slots.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from tandem.errors import TandemError
from tandem.runtime.planning.baseline import machine_baseline
from tandem.runtime.planning.costs import (
    COSTS,
    TORCH,
    TORCH_ALLOC_ROUND,
    TORCH_CUDA_HOST,
    TORCH_CUDA_HOST_CONTEXT,
    TORCH_HEAP_RETAINED,
    TORCH_SCORE_MATRICES,
    TORCH_WORK_FIXED,
)
from tandem.runtime.planning.llama_sizes import ContextSetup, sizes_for, work_buffer
from tandem.runtime.planning.shapes import (
    ModelShape,
    padded_ctx,
)

KINDS = ("llama.cpp", "torch", "onnxruntime")
ONNX_KV_COPIES = 6
"""Copies of the context's KV an onnxruntime step holds at its peak (fitted: 5.9)."""


@dataclass(frozen=True)
class Setup:
    """One model's runtime settings that move its memory."""

    n_ctx: int
    n_batch: int = 256
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: bool = False
    """As the llama.cpp backend (on anyway with a quantized V cache, which needs it)."""
    n_gpu_layers: int = 0
    output_rows: int = 1
    """Most logits rows asked for in one call (k+1 for a verifying target)."""
    host_expert_layers: int = 0
    """A MoE GGUF: the experts of its first N expert blocks stay in host memory (-1: all)."""


@dataclass(frozen=True)
class Item:
    label: str
    role: str
    """``target``, ``draft``, ``speculation`` or ``runtime``."""
    device: str
    """``host`` or ``gpu``."""
    bytes: int


@dataclass(frozen=True)
class Estimate:
    items: tuple[Item, ...] = field(default_factory=tuple)

    def total(self, device: str | None = None, role: str | None = None) -> int:
        return sum(i.bytes for i in self.items
                   if (device is None or i.device == device) and (role is None or i.role == role))

    @property
    def host(self) -> int:
        return self.total("host")

    @property
    def gpu(self) -> int:
        return self.total("gpu")

    def speculation_extra(self) -> int:
        """Everything speculation adds over running the target alone."""
        return self.total(role="draft") + self.total(role="speculation")

    def as_dict(self) -> dict:
        return {"host_bytes": self.host, "gpu_bytes": self.gpu,
                "items": [asdict(i) for i in self.items]}


def torch_capacity(tokens: int, start: int = 256) -> int:
    """Cells a doubling torch cache holds for ``tokens`` (see torch_engine.cache)."""
    cap = start
    while cap < tokens:
        cap *= 2
    return cap


def gpu_layers(n_layer: int, n_gpu_layers: int) -> tuple[int, bool]:
    """(blocks on the GPU, output layer on the GPU) for llama.cpp's ``n_gpu_layers``.

    llama.cpp counts ``n_layer + 1`` layers, the output layer (final norm and head) being
    the last, and offloads the last ``n_gpu_layers`` of them (``i_gpu_start = n_layer + 1
    - n_gpu_layers`` in ``llama_model::load_tensors``): the head goes first, then the
    blocks from the top down. A negative value means all of them."""
    if n_gpu_layers < 0 or n_gpu_layers > n_layer:
        return n_layer, True
    return max(n_gpu_layers - 1, 0), n_gpu_layers > 0


def gpu_head_bytes(shape: ModelShape) -> int:
    """Bytes the output layer takes on the GPU: its own tensors, and for a model whose
    head is tied to the token embedding (no ``output.weight``) a copy of that embedding,
    which llama.cpp loads a second time for the output layer's device (``TENSOR_DUPLICATED``)
    while the input layer keeps its own on the CPU."""
    return shape.output_bytes + (shape.input_bytes if shape.tied else 0)


def _kv(shape: ModelShape, setup: Setup, kind: str) -> int:
    per_token = shape.kv_bytes_per_token(setup.type_k, setup.type_v)
    if kind == "torch":
        return per_token * torch_capacity(setup.n_ctx)
    if kind == "onnxruntime":
        # Past, present and the graph's concatenations: ~6 copies measured (memory_costs.ONNX).
        return ONNX_KV_COPIES * per_token * setup.n_ctx
    return per_token * padded_ctx(setup.n_ctx)


def uses_llama_sizes(shape: ModelShape, setup: Setup, kind: str) -> bool:
    """Whether ``shape`` is priced from llama.cpp's own sizes (a GGUF on the CPU)."""
    return kind == "llama.cpp" and shape.path is not None and setup.n_gpu_layers == 0


def llama_cpu_items(shape: ModelShape, setup: Setup, role: str = "target") -> list[Item]:
    """A GGUF model in llama.cpp on the CPU, as the resident pages of its process:

    * **weights**: the file, memory-mapped (weights are used in place); the whole file
      is resident while it loads, so the header counts too. Repacked weights
      (``LlamaConfig.repack``, ``use_extra_bufts``) are read instead of mapped, so the
      process holds the same bytes;
    * **KV cache**: exact arithmetic over the padded cells (llama.cpp clears it: all resident);
    * **compute buffer**: what llama.cpp's scheduler reserves for this context with
      ``output_rows`` rows of logits (:mod:`tandem.runtime.planning.llama_sizes`): the largest
      graph, a full ubatch at a full context, touches all of it;
    * **logits**: llama.cpp's output buffer (``output_rows`` float32 rows over the
      vocabulary) and the copy the backend returns;
    * **work buffer**: the CPU backend converts a ubatch's activations for the matmul
      kernels (at most 4 bytes per element of the widest input: an upper bound);
    * **runtime**: the heap llama.cpp and our tokenizer keep for the loaded model
      (vocabulary, merges, tensor metadata, the coverage guard), measured by loading its
      metadata in a child process (:mod:`tandem.runtime.planning.llama_sizes`);
    * **context overhead**: context structures, the thread pool, first-decode
      allocations, measured once per machine with a tiny model (:func:`llama_context_overhead`).
    """
    sizes = sizes_for(shape.path)
    t = min(setup.n_batch, setup.n_ctx)
    flash = setup.flash_attn or setup.type_v not in ("f16", "f32", "bf16")
    ctx = sizes.context(ContextSetup(setup.n_ctx, t, setup.type_k, setup.type_v, flash, max(1, setup.output_rows)))
    kv = shape.kv_bytes_per_token(setup.type_k, setup.type_v) * padded_ctx(setup.n_ctx)
    rows = max(1, setup.output_rows)
    items = [
        Item(f"{role} weights ({shape.weight_type}, the file memory-mapped)", role, "host",
             shape.file_bytes or shape.weights_bytes),
        Item(f"{role} KV cache ({setup.type_k}/{setup.type_v}, {padded_ctx(setup.n_ctx)} cells)", role, "host", kv),
        Item(f"{role} compute buffer (batch {t}, reserved by llama.cpp)", role, "host", ctx.compute),
        Item(f"{role} logits ({rows} rows: llama.cpp's output buffer and our copy)", role, "host",
             2 * 4 * rows * shape.n_vocab),
        Item(f"{role} matmul work buffer (batch {t})", role, "host", work_buffer(t, padded_ctx(setup.n_ctx), shape.n_embd, shape.n_ff, shape.n_head,
                                                                          setup.type_v, setup.flash_attn)),
        Item(f"{role} runtime (vocabulary, tokenizer and metadata: measured)", role, "host", sizes.runtime),
        Item(f"{role} context, thread pool and first-decode allocations (measured on this machine)", role, "host",
             llama_context_overhead()),
    ]
    return [i for i in items if i.bytes]


def llama_context_overhead() -> int:
    """What a llama.cpp context takes beyond its priced buffers, measured on this machine
    with a tiny model (:mod:`tandem.runtime.planning.baseline`, cached)."""
    return machine_baseline().llama_context


def experts_kept_home(shape: ModelShape, g: int, host_expert_layers: int) -> int:
    """Expert bytes of the ``g`` offloaded blocks (the last ``g``) that stay in host memory
    because they are among the first ``host_expert_layers`` expert blocks (-1: all)."""
    if not host_expert_layers or not shape.expert_bytes:
        return 0
    layers = shape.expert_layers if host_expert_layers < 0 else shape.expert_layers[:host_expert_layers]
    return sum(shape.expert_bytes[i] for i in layers if i >= shape.n_layer - g)


def model_items(shape: ModelShape, setup: Setup, kind: str = "llama.cpp", role: str = "target",
                first_in_process: bool = True) -> list[Item]:
    """Weights, KV, compute and per-model runtime bytes of one model, by device.
    ``first_in_process=False``: another model of this kind is already loaded (a drafter
    next to its target), which set up the backend both share (``RuntimeCosts.per_model_next``).
    A GGUF on the CPU is priced from llama.cpp's own sizes (:func:`llama_cpu_items`)."""
    if uses_llama_sizes(shape, setup, kind):
        return llama_cpu_items(shape, setup, role)
    costs = COSTS[kind]
    g, head_on_gpu = gpu_layers(shape.n_layer, setup.n_gpu_layers)
    w_moved = (sum(shape.layer_bytes[shape.n_layer - g:]) + (shape.output_bytes if head_on_gpu else 0)
               - experts_kept_home(shape, g, setup.host_expert_layers))
    w_gpu = w_moved + (gpu_head_bytes(shape) - shape.output_bytes if head_on_gpu else 0)
    # llama.cpp maps the whole file and unmaps what it uploaded; the embedding stays.
    w_host = (shape.file_bytes or shape.weights_bytes) - w_moved
    kv = _kv(shape, setup, kind)
    kv_gpu = kv * g // max(shape.n_layer, 1)
    k = padded_ctx(setup.n_ctx, kind)
    # A ubatch never holds more tokens than the context (n_ctx, not its padded cells), and
    # only a context longer than one batch is ever filled in more than one ubatch.
    t = min(setup.n_batch, setup.n_ctx)
    if kind == "onnxruntime":  # no flash path: explicit score matrices (see memory_costs.ONNX)
        compute = int(k * t * costs.kth_plain * shape.n_head)
    elif kind == "torch":  # SDPA's math path on 3-D inputs: scores, softmax, masks (memory_costs.TORCH)
        compute = int(k * t * (costs.kt_plain + costs.kth_plain * shape.n_head) + t * shape.n_embd * costs.t_embd)
    elif setup.flash_attn:
        compute = int(k * t * costs.kt_flash + k * costs.k_flash + t * shape.n_embd * costs.t_embd_flash
                      + (t * costs.t_chunked if setup.n_ctx > t else 0))
    else:
        compute = int(k * t * (costs.kt_plain + costs.kth_plain * shape.n_head) + t * shape.n_embd * costs.t_embd)
    logits = int(setup.output_rows * shape.n_vocab * costs.out_row)
    items = [
        Item(f"{role} weights ({shape.weight_type})", role, "host", w_host),
        Item(f"{role} KV cache ({setup.type_k}/{setup.type_v}, {setup.n_ctx} tokens)", role, "host", kv - kv_gpu),
        Item(f"{role} compute buffer (batch {t})", role, "host", compute if g < shape.n_layer else compute // 4),
        Item(f"{role} logits rows ({setup.output_rows})", role, "host", logits),
        Item(f"{role} runtime and vocabulary" + ("" if first_in_process else " (second model in the process)"),
             role, "host", costs.model_runtime(shape.n_vocab, first_in_process)),
    ]
    if kind == "torch":
        items.append(Item(f"{role} heap kept by glibc (x{TORCH_HEAP_RETAINED} the KV)", role, "host",
                          int(TORCH_HEAP_RETAINED * (kv - kv_gpu))))
    if g or head_on_gpu:
        # A GPU buffer is allocated whole (cudaMalloc), not as touched: count the reserve.
        # llama.cpp's scheduler sizes one per backend for the graph nodes it runs there:
        # the blocks' attention and activations only when a block is on the GPU, and the
        # logits of a full batch (no n_outputs_max is set) when the output layer is.
        gpu_compute = (compute if g else 0) + (4 * t * shape.n_vocab if head_on_gpu else 0)
        items += [
            Item(f"{role} weights ({g}/{shape.n_layer} blocks" + (" and the output layer)" if head_on_gpu else ")"),
                 role, "gpu", w_gpu),
            Item(f"{role} KV cache ({g} layers)", role, "gpu", kv_gpu),
            Item(f"{role} compute buffer", role, "gpu", gpu_compute),
        ]
    return [i for i in items if i.bytes]


TORCH_GPU_PER_VOCAB = 64
"""Host bytes per vocabulary token of a torch drafter on the GPU (the earlier estimate, kept:
the CPU fit's ``TORCH.per_vocab`` was not measured for this case)."""


def _round(n: int) -> int:
    return -(-n // TORCH_ALLOC_ROUND) * TORCH_ALLOC_ROUND


def torch_gpu_items(shape: ModelShape, setup: Setup, role: str = "draft") -> list[Item]:
    """A model in the torch engine on a CUDA GPU: what ``torch.cuda.max_memory_allocated``
    sees (fitted on an H100, see ``test_torch_gpu_drafter_vram_matches_prediction``), plus
    its host side.

    * weights: float32, whatever the file's type (the torch engine dequantizes on load;
      the host copy is freed after the upload);
    * KV cache: float32 K and V plus an int64 position per cell, in the doubling cache of
      :mod:`tandem.runtime.backends.torch_engine.cache` (:func:`torch_capacity` cells);
    * workspace of the worst forward chunk (``n_batch`` tokens seeing a full context):
      :data:`TORCH_SCORE_MATRICES` attention matrices, activations, the logits rows.
      It dominates at long contexts (70 MB for a 1 MB drafter at 2048 × 512), which is
      why the planner gives a GPU drafter the same windows and batches as a CPU one.

    The CUDA context (device and host) is a per-process cost, added by :func:`estimate`."""
    cap = torch_capacity(setup.n_ctx)
    t = min(setup.n_batch, setup.n_ctx)
    weights = 4 * shape.n_params + TORCH_ALLOC_ROUND * (9 * shape.n_layer + 3)
    kv = 2 * shape.n_layer * _round(shape.kv_bytes_per_token("f32", "f32") // (2 * shape.n_layer) * cap) + 8 * cap
    scores = int(TORCH_SCORE_MATRICES * 4 * shape.n_head * t * setup.n_ctx)
    work = (scores + 4 * t * (4 * shape.n_embd + 2 * shape.n_ff)
            + 8 * (setup.output_rows + 1) * shape.n_vocab + TORCH_WORK_FIXED)
    return [
        Item(f"{role} weights (float32: the torch engine dequantizes)", role, "gpu", weights),
        Item(f"{role} KV cache (float32, {cap} cells)", role, "gpu", kv),
        Item(f"{role} attention, activations and logits (chunks of {t})", role, "gpu", work),
        Item(f"{role} torch runtime and vocabulary", role, "host", int(TORCH.per_model + TORCH_GPU_PER_VOCAB * shape.n_vocab)),
    ]


def speculation_items(target: ModelShape, k: int, kind: str = "llama.cpp") -> list[Item]:
    """Buffers speculation needs beyond the drafter itself, for up to ``k`` drafts/round:
    the drafter's q rows over the target vocabulary (float64 while sampling) and, for a
    growable cache, the k+1 candidate KV slots. (The k+1 verify logits rows are priced in
    the target's ``output_rows``.)"""
    if k <= 0:
        return []
    items = [Item(f"draft distributions ({k} rows)", "speculation", "host", 8 * k * target.n_vocab)]
    if kind != "llama.cpp":
        items.append(Item(f"candidate KV slots ({k + 1})", "speculation", "host",
                          (k + 1) * target.kv_bytes_per_token("f32", "f32")))
    return items


def estimate(
    target: ModelShape, target_setup: Setup, draft: ModelShape | None = None,
    draft_setup: Setup | None = None, *, k: int = 0, kind: str = "llama.cpp",
    draft_kind: str | None = None, draft_device: str = "cpu", include_process: bool = True,
    cuda_context_held: bool = False,
) -> Estimate:
    """The whole pair's memory. ``draft_device="cuda"`` prices the drafter in the torch
    engine on a CUDA GPU (:func:`torch_gpu_items`). ``include_process`` adds the
    runtime's once-per-process cost and, with anything on a GPU, the CUDA context (its
    device memory, and for torch its host side :data:`TORCH_CUDA_HOST`).
    ``cuda_context_held``: the process measured as the baseline already holds a CUDA
    context (planning asked CUDA for free VRAM), so the context's host share
    (:data:`TORCH_CUDA_HOST_CONTEXT`) is in that baseline and is not counted again."""
    if kind not in COSTS:
        raise TandemError(f"Unknown backend kind {kind!r}; choose one of {', '.join(KINDS)}.")
    items = model_items(target, target_setup, kind, "target")
    torch_gpu = draft is not None and draft_setup is not None and draft_device == "cuda"
    if torch_gpu:
        items += torch_gpu_items(draft, draft_setup, "draft")
    elif draft is not None and draft_setup is not None:
        d_kind = draft_kind or kind
        items += model_items(draft, draft_setup, d_kind, "draft", first_in_process=d_kind != kind)
    items += speculation_items(target, k, kind)
    if include_process:
        items.append(Item(f"{kind} runtime (once per process)", "runtime", "host", COSTS[kind].process))
        if torch_gpu:
            # The drafter is what brings CUDA into this process, so its context is its cost.
            items.append(Item("torch CUDA context and cuBLAS", "draft", "gpu", TORCH.device_context))
            host = max(0, TORCH_CUDA_HOST - (TORCH_CUDA_HOST_CONTEXT if cuda_context_held else 0))
            label = "torch CUDA runtime, host side (estimate" + (", context already in the baseline)" if cuda_context_held else ")")
            items.append(Item(label, "draft", "host", host))
        elif any(i.device == "gpu" for i in items):
            items.append(Item("GPU context", "runtime", "gpu", COSTS[kind].device_context))
    return Estimate(tuple(i for i in items if i.bytes))  # no 0 B rows
