"""A wide MoE for the offloading benchmark: a small MoEfied model widened to GB scale.

Expert offloading only pays when moving experts dominates a token's time, which needs
experts of many MB. ``tandem twin`` followed by ``tandem moefy`` gives wide experts, but
the twin's extra layers are identity blocks with all-zero FFNs, so moefy trains their
routers on all-zero targets and they always pick the same experts: most layers of a
GB-scale twin would route trivially and flatter any cache. This builder instead widens
an already MoEfied model (``tandem moefy SRC --experts 8 --top-k 2``), which is what
twin-then-moefy computes for the real layers (a twin's FFN inputs are its source's,
zero-padded), and gives every extra layer a *real* router:

* hidden size d -> D and expert width w -> W with zero padding and RMSNorm weights
  scaled by sqrt(d/D) (eps by d/D), exactly as :mod:`tandem.models.twin` does, so the
  widened model computes the small model's function;
* layer ``i >= L_src`` copies layer ``i mod L_src`` (attention, norms, router, expert
  gate/up) but with zero attention-output and expert-down projections: it adds nothing
  to the residual, yet routes each token input-dependently with a trained router and
  costs (compute, bytes) what a real layer of that shape costs.

Caveat, stated in BENCHMARKS.md: the extra layers all see the final residual of the
real layers, so their cross-layer gate predictions are easier than in a trained MoE.

    python -m benchmarks.moe_model SRC-moe.gguf -o wide.gguf --hidden 2048 --expert-width 1024 --layers 16
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import gguf
import numpy as np

from tandem.models.convert import PlannedTensor, write_streaming
from tandem.models.errors import UnsupportedModel
from tandem.models.twin import _as_f32, _copy_metadata, _field, _pad

NORMS = ("attn_norm", "ffn_norm", "output_norm")


def _shape(kind: str, src_shape: tuple[int, ...], hidden: int, width: int, heads: int, kv_heads: int,
           head_dim: int) -> tuple[int, ...]:
    """numpy shape of tensor ``kind`` in the widened model."""
    if kind in NORMS:
        return (hidden,)
    e = src_shape[0]
    return {
        "token_embd": (src_shape[0], hidden), "output": (src_shape[0], hidden),
        "attn_q": (heads * head_dim, hidden), "attn_k": (kv_heads * head_dim, hidden),
        "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, heads * head_dim),
        "ffn_gate_inp": (e, hidden), "ffn_gate_exps": (e, width, hidden), "ffn_up_exps": (e, width, hidden),
        "ffn_down_exps": (e, hidden, width),
    }[kind]


def widen_moe(src: str | os.PathLike[str], out: str | os.PathLike[str], hidden: int, expert_width: int,
              layers: int) -> Path:
    """Write the widened copy of the MoE Llama GGUF ``src`` (see the module docstring)."""
    src, out = Path(src), Path(out)
    reader = gguf.GGUFReader(src)
    if _field(reader, "llama.expert_count") is None:
        raise UnsupportedModel(f"{src} is not a mixture-of-experts Llama GGUF (run tandem moefy first).")
    d = int(_field(reader, "llama.embedding_length"))
    w = int(_field(reader, "llama.feed_forward_length"))
    n_src = int(_field(reader, "llama.block_count"))
    heads = int(_field(reader, "llama.attention.head_count"))
    kv_heads = int(_field(reader, "llama.attention.head_count_kv") or heads)
    head_dim = d // heads
    ratio = heads // kv_heads
    if hidden < d or expert_width < w or layers < n_src or hidden % (head_dim * ratio):
        raise UnsupportedModel(f"cannot widen {d}x{w}x{n_src} to {hidden}x{expert_width}x{layers} "
                               f"(hidden must be a multiple of {head_dim * ratio}).")
    new_heads = hidden // head_dim
    scale = math.sqrt(d / hidden)
    by_name = {t.name: t for t in reader.tensors}
    eps = float(_field(reader, "llama.attention.layer_norm_rms_epsilon") or 1e-5)

    def planned(name: str, source: str, zero: bool = False) -> PlannedTensor:
        kind = name.split(".")[-2]
        t = by_name[source]
        shape = _shape(kind, tuple(int(x) for x in reversed(t.shape.tolist())), hidden, expert_width,
                       new_heads, new_heads // ratio, head_dim)

        def make() -> np.ndarray:
            if zero:
                return np.zeros(shape, np.float32)
            a = _as_f32(t).reshape(tuple(int(x) for x in reversed(t.shape.tolist())))
            return _pad(a * scale if kind in NORMS else a, shape)

        return PlannedTensor(name, shape, np.float32, make)

    plan = [planned(n, n) for n in ("token_embd.weight", "output_norm.weight", "output.weight") if n in by_name]
    for i in range(layers):
        j = i % n_src
        for t in reader.tensors:
            if t.name.startswith(f"blk.{j}."):
                rest = t.name[len(f"blk.{j}."):]
                silent = i >= n_src and rest in ("attn_output.weight", "ffn_down_exps.weight")
                plan.append(planned(f"blk.{i}.{rest}", t.name, zero=silent))
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(out, "llama")
    _copy_metadata(reader, writer)
    writer.add_name(f"{src.stem} widened {hidden}x{expert_width}x{layers}")
    writer.add_file_type(0)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(expert_width)
    writer.add_block_count(layers)
    writer.add_head_count(new_heads)
    writer.add_head_count_kv(new_heads // ratio)
    writer.add_layer_norm_rms_eps(eps * d / hidden)
    writer.add_string("tandem.widened.source", src.name)
    write_streaming(writer, plan)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("src", type=Path, help="a MoE Llama GGUF (from tandem moefy)")
    ap.add_argument("-o", "--out", type=Path, required=True)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--expert-width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    args = ap.parse_args()
    path = widen_moe(args.src, args.out, args.hidden, args.expert_width, args.layers)
    print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB)")


if __name__ == "__main__":
    main()
