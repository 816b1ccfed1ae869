"""Real-shape GGUF models with random quantized weights, written in seconds: timing stand-ins
for models whose files cannot reach the GPU machine (7B and MoE shapes).

``../shared/gpu``'s kit fills skeletons of the real small models with random F16 weights and
quantizes them, which takes minutes for a 1.5B model. A 7B or 30B model done that way would
not fit a GPU session, so this writes quantized blocks directly: every matrix is Q4_K (Q6_K
where llama.cpp's Q4_K_M puts it: the output head, and ``attn_v``/``ffn_down`` in the layers
its "more bits" rule picks), norms are F32 ones, biases and the MoE router random F32.
A block's scales are set to small finite values and its quants are random, so a decode runs
the same kernels on the same bytes per token as the real file, and its logits are finite.
Acceptance of drafts on such a model means nothing; its costs are real.

The tokenizer (and so the vocabulary size) is copied from a real Qwen2.5 GGUF or skeleton,
e.g. ``.gpu-kit/skel/qwen2.5-coder-1.5b.gguf``; only ``gguf`` and ``numpy`` are needed.

    python -m benchmarks.gpu_shapes qwen2.5-7b OUT.gguf --vocab-from SRC.gguf
    python -m benchmarks.gpu_shapes qwen3-30b-a3b OUT.gguf --vocab-from SRC.gguf [--layers 4]

``--sparse`` writes the header only and leaves the weights a hole of zeros (a sparse file, a
few MB on disk): a stand-in for planning (``tandem plan`` reads headers, llama.cpp's sizes
come from metadata), which runs but computes nothing worth timing.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np

Q4_K, Q6_K, F32 = 12, 14, 0
"""ggml type ids."""
BLOCK = {Q4_K: (256, 144), Q6_K: (256, 210)}
"""Values per block and bytes per block of the quantized types."""
FILE_TYPE_Q4_K_M = 15


@dataclass(frozen=True)
class Shape:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    ctx: int
    tied: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    head_dim: int = 0

    @property
    def hd(self) -> int:
        return self.head_dim or self.n_embd // self.n_head


SHAPES = {
    # Qwen2.5-7B(-Instruct / -Coder): 28 layers, 3584 wide, GQA 28/4, FFN 18944, untied head
    "qwen2.5-7b": Shape("qwen2", 28, 3584, 28, 4, 18944, 32768, qkv_bias=True),
    # Qwen2.5-14B: 48 layers, 5120 wide, GQA 40/8, FFN 13824
    "qwen2.5-14b": Shape("qwen2", 48, 5120, 40, 8, 13824, 32768, qkv_bias=True),
    # Qwen3-30B-A3B: 48 layers, 2048 wide, 128 experts of 768, 8 used, q/k norms, head dim 128
    "qwen3-30b-a3b": Shape("qwen3moe", 48, 2048, 32, 4, 6144, 40960, qk_norm=True, n_expert=128,
                           n_expert_used=8, n_ff_exp=768, head_dim=128),
}


def more_bits(layer: int, n_layer: int) -> bool:
    """llama.cpp's Q4_K_M rule for ``attn_v`` and ``ffn_down``: Q6_K in the first and last
    eighth of the layers and every third layer between."""
    eighth = n_layer // 8
    return layer < eighth or layer >= 7 * n_layer // 8 or (layer - eighth) % 3 == 2


def tensors(s: Shape, n_vocab: int) -> Iterator[tuple[str, tuple[int, ...], int]]:
    """(name, numpy-order shape, ggml type) of every tensor, in file order."""
    q, kv = s.n_head * s.hd, s.n_head_kv * s.hd
    yield "token_embd.weight", (n_vocab, s.n_embd), Q4_K
    for i in range(s.n_layer):
        b = f"blk.{i}."
        wide = Q6_K if more_bits(i, s.n_layer) else Q4_K
        yield b + "attn_norm.weight", (s.n_embd,), F32
        yield b + "attn_q.weight", (q, s.n_embd), Q4_K
        yield b + "attn_k.weight", (kv, s.n_embd), Q4_K
        yield b + "attn_v.weight", (kv, s.n_embd), wide
        if s.qkv_bias:
            yield b + "attn_q.bias", (q,), F32
            yield b + "attn_k.bias", (kv,), F32
            yield b + "attn_v.bias", (kv,), F32
        if s.qk_norm:
            yield b + "attn_q_norm.weight", (s.hd,), F32
            yield b + "attn_k_norm.weight", (s.hd,), F32
        yield b + "attn_output.weight", (s.n_embd, q), Q4_K
        yield b + "ffn_norm.weight", (s.n_embd,), F32
        if s.n_expert:
            yield b + "ffn_gate_inp.weight", (s.n_expert, s.n_embd), F32
            yield b + "ffn_gate_exps.weight", (s.n_expert, s.n_ff_exp, s.n_embd), Q4_K
            yield b + "ffn_up_exps.weight", (s.n_expert, s.n_ff_exp, s.n_embd), Q4_K
            yield b + "ffn_down_exps.weight", (s.n_expert, s.n_embd, s.n_ff_exp), wide
        else:
            yield b + "ffn_gate.weight", (s.n_ff, s.n_embd), Q4_K
            yield b + "ffn_up.weight", (s.n_ff, s.n_embd), Q4_K
            yield b + "ffn_down.weight", (s.n_embd, s.n_ff), wide
    yield "output_norm.weight", (s.n_embd,), F32
    if not s.tied:
        yield "output.weight", (n_vocab, s.n_embd), Q6_K


def nbytes(shape: tuple[int, ...], kind: int) -> int:
    if kind == F32:
        return 4 * int(np.prod(shape))
    per, size = BLOCK[kind]
    assert shape[-1] % per == 0, f"rows of {shape[-1]} values do not hold whole {per}-value blocks"
    return int(np.prod(shape[:-1])) * shape[-1] // per * size


def block_pool(kind: int, n_blocks: int, rng: np.random.Generator) -> bytes:
    """Random blocks of ``kind`` with small finite f16 scales (random quants and sub-scales)."""
    per, size = BLOCK[kind]
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    if kind == Q4_K:  # d, dmin (f16) first
        raw[:, 0:2] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
        raw[:, 2:4] = np.frombuffer(np.float16(0.001).tobytes(), np.uint8)
    else:  # Q6_K: ql[128] qh[64] scales[16] (int8) d (f16) last
        raw[:, 192:208] = rng.integers(1, 16, size=(n_blocks, 16), dtype=np.uint8)
        raw[:, 208:210] = np.frombuffer(np.float16(0.0005).tobytes(), np.uint8)
    return raw.tobytes()


def copy_tokenizer(reader, writer) -> int:
    """Copy the ``tokenizer.*`` keys; returns the vocabulary size."""
    import gguf

    n_vocab = 0
    for f in reader.fields.values():
        if not f.name.startswith("tokenizer."):
            continue
        vt = f.types[0]
        sub = f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None
        value = f.contents()
        writer.add_key_value(f.name, value, vt, sub_type=sub)
        if f.name == "tokenizer.ggml.tokens":
            n_vocab = len(value)
    return n_vocab


def write(name: str, out: str, vocab_from: str, layers: int | None = None, sparse: bool = False) -> int:
    import gguf

    s = SHAPES[name]
    if layers:
        s = replace(s, n_layer=layers)
    reader = gguf.GGUFReader(vocab_from)
    w = gguf.GGUFWriter(out, s.arch)
    w.add_name(f"{name} shape, random weights")
    n_vocab = copy_tokenizer(reader, w)
    a = s.arch
    w.add_uint32(f"{a}.context_length", s.ctx)
    w.add_uint32(f"{a}.embedding_length", s.n_embd)
    w.add_uint32(f"{a}.block_count", s.n_layer)
    w.add_uint32(f"{a}.feed_forward_length", s.n_ff)
    w.add_uint32(f"{a}.attention.head_count", s.n_head)
    w.add_uint32(f"{a}.attention.head_count_kv", s.n_head_kv)
    w.add_float32(f"{a}.rope.freq_base", 1_000_000.0)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    if s.head_dim:
        w.add_uint32(f"{a}.attention.key_length", s.hd)
        w.add_uint32(f"{a}.attention.value_length", s.hd)
    if s.n_expert:
        w.add_uint32(f"{a}.expert_count", s.n_expert)
        w.add_uint32(f"{a}.expert_used_count", s.n_expert_used)
        w.add_uint32(f"{a}.expert_feed_forward_length", s.n_ff_exp)
    w.add_uint32("general.file_type", FILE_TYPE_Q4_K_M)
    plan = list(tensors(s, n_vocab))
    for tname, shape, kind in plan:
        if kind == F32:
            w.add_tensor_info(tname, shape, np.dtype(np.float32), nbytes(shape, kind))
        else:
            byte_shape = (*shape[:-1], nbytes((shape[-1],), kind))
            w.add_tensor_info(tname, byte_shape, np.dtype(np.uint8), nbytes(shape, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    if sparse:
        with open(out, "r+b") as fh:
            fh.seek(0, 2)
            start = fh.tell() + (-fh.tell() % 32)
            total = sum(nbytes(shape, kind) for _, shape, kind in plan)
            fh.truncate(start + sum(nbytes(shape, kind) + (-nbytes(shape, kind) % 32) for _, shape, kind in plan))
        return total
    rng = np.random.default_rng(0)
    pools = {k: block_pool(k, (64 << 20) // BLOCK[k][1], rng) for k in BLOCK}
    floats = (rng.standard_normal(1 << 22).astype(np.float32) * 0.02).tobytes()
    total = 0
    with open(out, "ab") as fh:
        fh.write(b"\0" * (-fh.tell() % 32))
        for tname, shape, kind in plan:
            size = nbytes(shape, kind)
            if kind == F32:
                pool = np.ones(size // 4, np.float32).tobytes() if "norm" in tname else floats
            else:
                pool = pools[kind]
            left = size
            while left:
                chunk = min(left, len(pool) - len(pool) % (4 if kind == F32 else BLOCK[kind][1]))
                fh.write(pool[:chunk] if chunk < len(pool) else pool)
                left -= chunk
            fh.write(b"\0" * (-size % 32))
            total += size
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out")
    ap.add_argument("--vocab-from", required=True, help="a Qwen2.5 GGUF (or kit skeleton) to take the tokenizer from")
    ap.add_argument("--layers", type=int, help="fewer layers (tests only: the shape is no longer real)")
    ap.add_argument("--sparse", action="store_true", help="header only, zero weights in a sparse file (planning)")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    size = write(args.shape, args.out, args.vocab_from, args.layers, args.sparse)
    print(f"{args.out}: {args.shape}, {size / 2**30:.2f} GiB of weights in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
