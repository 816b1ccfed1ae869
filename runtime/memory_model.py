"""How many bytes a target + drafter pair needs, per device, before anything is loaded.

Pure arithmetic over model shapes (read from GGUF headers or HF configs) and runtime
settings, so the planner can price options for this machine or for another one.

The llama.cpp terms are the resident pages of a CPU process (what the OS must find
room for), itemised as:

* **weights**: tensor bytes per layer; ``n_gpu_layers`` moves the *last* layers (and,
  when all are moved, the output head) to the GPU, as llama.cpp does. The token
  embedding always stays on the host.
* **KV cache**: ``kv_bytes_per_token`` (by K/V type) times the context, split by layer
  like the weights. llama.cpp clears the cache at creation, so all of it is resident.
* **compute**: the graph buffer as far as the worst ubatch (``n_batch`` tokens at a full
  context) touches it. Without flash attention the K·Q score matrix
  (context × batch × heads × 4 bytes) dominates; with it, the mask and activations.
* **runtime**: per-process and per-model constants plus the vocabulary tables.
* **speculation**: logits rows for verification (k+1 rows of n_vocab float32 in
  llama.cpp's output buffer and in our numpy copy), the drafter's q rows, and — for a
  growable cache (torch) — the candidate KV slots. A llama.cpp cache is preallocated, so
  candidates live inside ``n_ctx``, which the planner sizes to context + k + 1.

The constants of :data:`LLAMA_CPP` were fitted (least squares) to resident-set
measurements made with :mod:`tandem.runtime.memprobe` on stories260K and three synthetic
llama GGUFs (vocab 512/32000, width 64-512, 3-6 layers, F32/F16/Q8_0), over contexts
256-2048, batches 64-512, flash attention on and off; max in-sample error 6 % except
one point (stories260K, batch 512, flash attention: +16 %, an over-estimate). A model
in the torch engine on a CUDA GPU is priced in VRAM by :func:`torch_gpu_items`, fitted
to ``torch.cuda.max_memory_allocated`` on an H100 (-1 % to +6 %). The other torch and
onnxruntime constants are first estimates (documented at each) not yet fitted to
measurements; their weights and KV terms are exact arithmetic.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tandem.models.errors import TandemError

KINDS = ("llama.cpp", "torch", "onnxruntime")
KV_TYPE_SIZES = {"f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q5_1": (32, 24),
                 "q5_0": (32, 22), "q4_1": (32, 20), "q4_0": (32, 18)}
"""(block, bytes per block) of each KV cache type, as ggml stores them."""
KV_PAD = 256
"""llama.cpp rounds the KV cache's cell count up to this many (padding for kernels)."""


@dataclass(frozen=True)
class ModelShape:
    """What the memory model needs to know about one model."""

    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    layer_bytes: tuple[int, ...]
    """Weight bytes of each block, in order."""
    input_bytes: int
    """Token embedding (always on the host in llama.cpp)."""
    output_bytes: int
    """Final norm and output head (offloaded only when every layer is)."""
    weight_type: str = "f32"
    n_params: int = 0

    @property
    def weights_bytes(self) -> int:
        return sum(self.layer_bytes) + self.input_bytes + self.output_bytes

    def kv_bytes_per_token(self, type_k: str = "f16", type_v: str = "f16") -> int:
        """Bytes of K and V per token over all layers (same rule as llama.cpp)."""
        def row(type_name: str, width: int) -> int:
            block, size = KV_TYPE_SIZES[type_name]
            return width // block * size

        width_k, width_v = self.head_dim_k * self.n_head_kv, self.head_dim_v * self.n_head_kv
        return self.n_layer * (row(type_k, width_k) + row(type_v, width_v))

    def kv_type_ok(self, type_name: str) -> bool:
        block = KV_TYPE_SIZES[type_name][0]
        return self.head_dim_k % block == 0 and self.head_dim_v % block == 0


_BLOCK = re.compile(r"^blk\.(\d+)\.")


QUANT_COPY_TYPES = ("q8_0", "f16")
"""Types :func:`shape_from_gguf` can price a llama.cpp-quantized copy in (whole-file
types with one rule per tensor; the mixed K-quant presets choose per tensor)."""


def _copy_nbytes(name: str, shape: tuple[int, ...], nbytes: int, as_type: str) -> int:
    """Bytes of one tensor after ``llama_model_quantize`` to ``as_type``: 2-D+ weights
    take the type when their rows hold whole blocks and fall back to f16 otherwise
    (checked against llama.cpp on stories260K, whose 172-wide ffn_down stays f16);
    1-D tensors (norms, biases) keep their type."""
    if len(shape) < 2 or not name.endswith("weight"):
        return nbytes
    block, size = KV_TYPE_SIZES[as_type if shape[0] % KV_TYPE_SIZES[as_type][0] == 0 else "f16"]
    return math.prod(shape) // block * size


def shape_from_gguf(path_or_info, as_type: str | None = None) -> ModelShape:
    """A :class:`ModelShape` from a GGUF header (no tensor data is read); with
    ``as_type`` (one of :data:`QUANT_COPY_TYPES`), the shape of the copy llama.cpp's
    quantizer would make, so the planner can price a quantized drafter before making it."""
    from tandem.models.gguf_file import GGUFInfo, inspect_gguf

    info: GGUFInfo = path_or_info if isinstance(path_or_info, GGUFInfo) else inspect_gguf(path_or_info)
    if as_type is not None and as_type not in QUANT_COPY_TYPES:
        raise TandemError(f"Cannot price a {as_type} copy; choose one of {', '.join(QUANT_COPY_TYPES)}.")
    n_layer = int(info.arch_value("block_count", 0) or 0)
    n_head = int(info.arch_value("attention.head_count", 1) or 1)
    n_embd = int(info.arch_value("embedding_length", 0) or 0)
    k_dim = int(info.arch_value("attention.key_length", n_embd // max(n_head, 1)))
    layers = [0] * n_layer
    inp = out = 0
    types: dict[int, int] = {}
    for t in info.tensors:
        nbytes = t.nbytes if as_type is None else _copy_nbytes(t.name, tuple(t.shape), t.nbytes, as_type)
        m = _BLOCK.match(t.name)
        if m and int(m.group(1)) < n_layer:
            layers[int(m.group(1))] += nbytes
            types[t.ggml_type] = types.get(t.ggml_type, 0) + nbytes
        elif t.name.startswith("token_embd"):
            inp += nbytes
        else:
            out += nbytes
    tokens = info.metadata.get("tokenizer.ggml.tokens")
    n_vocab = getattr(tokens, "length", None) or (len(tokens) if isinstance(tokens, list) else 0)
    import gguf

    wtype = gguf.GGMLQuantizationType(max(types, key=types.get)).name.lower() if types else "f32"
    return ModelShape(
        name=info.path.stem if as_type is None else f"{info.path.stem} ({as_type.upper()} copy)", n_layer=n_layer, n_embd=n_embd, n_head=n_head,
        n_head_kv=int(info.arch_value("attention.head_count_kv", n_head) or n_head),
        head_dim_k=k_dim, head_dim_v=int(info.arch_value("attention.value_length", k_dim)),
        n_ff=int(info.arch_value("feed_forward_length", 0) or 0), n_vocab=int(n_vocab),
        n_ctx_train=int(info.arch_value("context_length", 2048) or 2048),
        layer_bytes=tuple(layers), input_bytes=inp, output_bytes=out, weight_type=as_type or wtype,
        n_params=info.n_params,
    )


def shape_from_hf(folder: str | Path, dtype_bytes: int = 4) -> ModelShape:
    """A :class:`ModelShape` from a Hugging Face Llama folder (config.json), weights in
    ``dtype_bytes`` per parameter (the torch engine's dtype, not the file's)."""
    cfg_path = Path(folder) / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as exc:
        raise TandemError(f"Cannot read {cfg_path}: {exc}") from None
    e, layers, ff, v = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    h = cfg["num_attention_heads"]
    hkv = cfg.get("num_key_value_heads", h)
    hd = cfg.get("head_dim", e // h)
    per_layer = e * h * hd + 2 * e * hkv * hd + h * hd * e + 3 * e * ff + 2 * e
    tied = cfg.get("tie_word_embeddings", False)
    return ModelShape(
        name=Path(folder).name, n_layer=layers, n_embd=e, n_head=h, n_head_kv=hkv, head_dim_k=hd,
        head_dim_v=hd, n_ff=ff, n_vocab=v, n_ctx_train=cfg.get("max_position_embeddings", 2048),
        layer_bytes=(per_layer * dtype_bytes,) * layers, input_bytes=v * e * dtype_bytes,
        output_bytes=(e + (0 if tied else v * e)) * dtype_bytes, weight_type=f"{8 * dtype_bytes}-bit float",
        n_params=layers * per_layer + v * e * (1 if tied else 2) + e,
    )


@dataclass(frozen=True)
class RuntimeCosts:
    """Measured constants of one backend kind (bytes; coefficients per unit named)."""

    process: int
    """Once per process: runtime initialisation (thread pool, backend registry)."""
    per_model: int
    per_vocab: float
    """Vocabulary tables, per token of the vocabulary."""
    kt_flash: float
    """Compute bytes per (context cell × batch token) with flash attention (mask, tiles)."""
    kt_plain: float
    kth_plain: float
    """Score-matrix bytes per (context × batch × head) without flash attention."""
    t_embd: float
    """Activation bytes per (batch token × hidden width)."""
    out_row: float
    """Bytes per logits row element (llama.cpp output buffer + graph result + our copy)."""
    device_context: int = 0
    """Once per process on a CUDA device: context, cuBLAS workspace."""


LLAMA_CPP = RuntimeCosts(process=0, per_model=2_200_000, per_vocab=192.5, kt_flash=6.91,
                         kt_plain=7.14, kth_plain=5.54, t_embd=27.8, out_row=11.55,
                         device_context=350 * 1024**2)
"""llama.cpp (CPU build; fitted, see module docstring). ``process`` is 0: what llama.cpp
adds once per process is shared-library code, which :mod:`tandem.runtime.memprobe` no
longer counts (its resident size depends on the page cache, not the model).
``device_context`` is the usual CUDA context + cuBLAS handle size (~300-400 MiB), an
estimate not measured here."""

TORCH_CUDA_HOST = 300 * 1024**2
"""Host RSS that torch's CUDA runtime adds once a drafter runs on the GPU (context,
driver mappings, cuBLAS). Measured 272 MiB on an H100 with torch 2.11+cu130 (133 MiB at
context creation, 139 MiB at the first matmul); other drivers differ, so it is a named
constant for a measurement to replace. Only the first CUDA user of a process pays it;
planning on a detected GPU has already created the context (free VRAM is asked of
CUDA), so there this errs large by the context's share."""
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

TORCH = RuntimeCosts(process=0, per_model=8_000_000, per_vocab=64.0, kt_flash=4.0, kt_plain=4.0,
                     kth_plain=8.0, t_embd=48.0, out_row=8.0, device_context=TORCH_CUDA_DEVICE)
"""torch engine (estimate): ``import torch`` itself (~250-350 MB) is in the process
baseline, not here; scores are materialised (q·k then softmax: 2 × 4 bytes per
element); activations ~12 float32 per hidden unit per token."""

ONNX = RuntimeCosts(process=20_000_000, per_model=10_000_000, per_vocab=64.0, kt_flash=4.0, kt_plain=4.0,
                    kth_plain=8.0, t_embd=48.0, out_row=8.0, device_context=500 * 1024**2)
"""onnxruntime (estimate): the CPU arena keeps freed blocks, so activations are counted
at their peak; past and present KV both live during a step (counted in :func:`_kv`)."""

COSTS = {"llama.cpp": LLAMA_CPP, "torch": TORCH, "onnxruntime": ONNX}



@dataclass(frozen=True)
class Setup:
    """One model's runtime settings that move its memory."""

    n_ctx: int
    n_batch: int = 256
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: bool = True
    n_gpu_layers: int = 0
    output_rows: int = 1
    """Most logits rows asked for in one call (k+1 for a verifying target)."""


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


def padded_ctx(n_ctx: int, kind: str = "llama.cpp") -> int:
    return math.ceil(n_ctx / KV_PAD) * KV_PAD if kind == "llama.cpp" else n_ctx


def torch_capacity(tokens: int, start: int = 256) -> int:
    """Cells a doubling torch cache holds for ``tokens`` (see torch_engine.cache)."""
    cap = start
    while cap < tokens:
        cap *= 2
    return cap


def _gpu_layers(shape: ModelShape, n_gpu_layers: int) -> tuple[int, bool]:
    """(blocks on the GPU, output head on the GPU) for llama.cpp's ``n_gpu_layers``."""
    if n_gpu_layers < 0 or n_gpu_layers > shape.n_layer:
        return shape.n_layer, True
    return n_gpu_layers, False


def _kv(shape: ModelShape, setup: Setup, kind: str) -> int:
    per_token = shape.kv_bytes_per_token(setup.type_k, setup.type_v)
    if kind == "torch":
        return per_token * torch_capacity(setup.n_ctx)
    if kind == "onnxruntime":
        return 2 * per_token * setup.n_ctx  # past and present both live during a step
    return per_token * padded_ctx(setup.n_ctx)


def model_items(shape: ModelShape, setup: Setup, kind: str = "llama.cpp", role: str = "target") -> list[Item]:
    """Weights, KV, compute and per-model runtime bytes of one model, by device."""
    costs = COSTS[kind]
    g, head_on_gpu = _gpu_layers(shape, setup.n_gpu_layers)
    first_gpu = shape.n_layer - g
    w_gpu = sum(shape.layer_bytes[first_gpu:]) + (shape.output_bytes if head_on_gpu else 0)
    w_host = shape.weights_bytes - w_gpu
    kv = _kv(shape, setup, kind)
    kv_gpu = kv * g // max(shape.n_layer, 1)
    k = padded_ctx(setup.n_ctx, kind)
    t = min(setup.n_batch, k)
    kt = k * t * (costs.kt_flash if setup.flash_attn else costs.kt_plain + costs.kth_plain * shape.n_head)
    compute = int(kt + t * shape.n_embd * costs.t_embd)
    logits = int(setup.output_rows * shape.n_vocab * costs.out_row)
    items = [
        Item(f"{role} weights ({shape.weight_type})", role, "host", w_host),
        Item(f"{role} KV cache ({setup.type_k}/{setup.type_v}, {setup.n_ctx} tokens)", role, "host", kv - kv_gpu),
        Item(f"{role} compute buffer (batch {t})", role, "host", compute if g < shape.n_layer else compute // 4),
        Item(f"{role} logits rows ({setup.output_rows})", role, "host", logits),
        Item(f"{role} runtime and vocabulary", role, "host", int(costs.per_model + costs.per_vocab * shape.n_vocab)),
    ]
    if g:
        # A GPU buffer is allocated whole (cudaMalloc), not as touched: count the reserve,
        # which also holds the logits of a full batch when the head is offloaded.
        gpu_compute = compute + (4 * t * shape.n_vocab if head_on_gpu else 0)
        items += [
            Item(f"{role} weights ({g}/{shape.n_layer} layers)", role, "gpu", w_gpu),
            Item(f"{role} KV cache ({g} layers)", role, "gpu", kv_gpu),
            Item(f"{role} compute buffer", role, "gpu", gpu_compute),
        ]
    return [i for i in items if i.bytes]


def _round(n: int) -> int:
    return -(-n // TORCH_ALLOC_ROUND) * TORCH_ALLOC_ROUND


def torch_gpu_items(shape: ModelShape, setup: Setup, role: str = "draft") -> list[Item]:
    """A model in the torch engine on a CUDA GPU: what ``torch.cuda.max_memory_allocated``
    sees (fitted on an H100, see ``test_torch_gpu_drafter_vram_matches_prediction``), plus
    its host side.

    * weights: float32, whatever the file's type (the torch engine dequantizes on load;
      the host copy is freed after the upload);
    * KV cache: float32 K and V plus an int64 position per cell, in the doubling cache of
      :mod:`tandem.runtime.torch_engine.cache` (:func:`torch_capacity` cells);
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
        Item(f"{role} torch runtime and vocabulary", role, "host", int(TORCH.per_model + TORCH.per_vocab * shape.n_vocab)),
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
) -> Estimate:
    """The whole pair's memory. ``draft_device="cuda"`` prices the drafter in the torch
    engine on a CUDA GPU (:func:`torch_gpu_items`). ``include_process`` adds the
    runtime's once-per-process cost and, with anything on a GPU, the CUDA context (its
    device memory, and for torch its host side :data:`TORCH_CUDA_HOST`)."""
    if kind not in COSTS:
        raise TandemError(f"Unknown backend kind {kind!r}; choose one of {', '.join(KINDS)}.")
    items = model_items(target, target_setup, kind, "target")
    torch_gpu = draft is not None and draft_setup is not None and draft_device == "cuda"
    if torch_gpu:
        items += torch_gpu_items(draft, draft_setup, "draft")
    elif draft is not None and draft_setup is not None:
        items += model_items(draft, draft_setup, draft_kind or kind, "draft")
    items += speculation_items(target, k, kind)
    if include_process:
        items.append(Item(f"{kind} runtime (once per process)", "runtime", "host", COSTS[kind].process))
        if torch_gpu:
            # The drafter is what brings CUDA into this process, so its context is its cost.
            items.append(Item("torch CUDA context and cuBLAS", "draft", "gpu", TORCH.device_context))
            items.append(Item("torch CUDA runtime, host side (estimate)", "draft", "host", TORCH_CUDA_HOST))
        elif any(i.device == "gpu" for i in items):
            items.append(Item("GPU context", "runtime", "gpu", COSTS[kind].device_context))
    return Estimate(tuple(items))
