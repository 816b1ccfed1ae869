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
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np

from tandem.errors import UnsupportedModel
from tandem.models.convert import PlannedTensor, write_streaming
from tandem.models.shape import DecoderShape, dims_from_gguf
from tandem.models.twin import _as_f32, _copy_metadata, _field, _pad

NORMS = ("attn_norm", "ffn_norm", "output_norm")


def _shape(kind: str, src_shape: tuple[int, ...], dims: DecoderShape) -> tuple[int, ...]:
    """numpy shape of tensor ``kind`` in the widened model (``dims.n_ff``: one expert's width)."""
    if kind in NORMS:
        return (dims.n_embd,)
    e, n_embd, q = src_shape[0], dims.n_embd, dims.n_head * dims.head_dim
    return {
        "token_embd": (src_shape[0], n_embd), "output": (src_shape[0], n_embd),
        "attn_q": (q, n_embd), "attn_k": (dims.kv_width, n_embd),
        "attn_v": (dims.kv_width, n_embd), "attn_output": (n_embd, q),
        "ffn_gate_inp": (e, n_embd), "ffn_gate_exps": (e, dims.n_ff, n_embd), "ffn_up_exps": (e, dims.n_ff, n_embd),
        "ffn_down_exps": (e, n_embd, dims.n_ff),
    }[kind]


def widen_moe(src: str | os.PathLike[str], out: str | os.PathLike[str], n_embd: int, n_ff_exp: int,
              n_layer: int) -> Path:
    """Write the widened copy of the MoE Llama GGUF ``src`` (see the module docstring)."""
    src, out = Path(src), Path(out)
    reader = gguf.GGUFReader(src)
    if _field(reader, "llama.expert_count") is None:
        raise UnsupportedModel(f"{src} is not a mixture-of-experts Llama GGUF (run tandem moefy first).")
    names = {t.name for t in reader.tensors}
    n_vocab = next(int(t.shape[1]) for t in reader.tensors if t.name == "token_embd.weight")
    old = dims_from_gguf(lambda key, default: _field(reader, f"llama.{key}") or default, n_vocab,
                         tied="output.weight" not in names)
    ratio = old.n_head // old.n_head_kv
    if n_embd < old.n_embd or n_ff_exp < old.n_ff or n_layer < old.n_layer or n_embd % (old.head_dim * ratio):
        raise UnsupportedModel(f"cannot widen {old.n_embd}x{old.n_ff}x{old.n_layer} to {n_embd}x{n_ff_exp}x{n_layer} "
                               f"(--hidden must be a multiple of {old.head_dim * ratio}).")
    new_heads = n_embd // old.head_dim
    new = replace(old, n_embd=n_embd, n_ff=n_ff_exp, n_layer=n_layer, n_head=new_heads, n_head_kv=new_heads // ratio)
    n_src, d = old.n_layer, old.n_embd
    scale = math.sqrt(d / n_embd)
    by_name = {t.name: t for t in reader.tensors}
    eps = float(_field(reader, "llama.attention.layer_norm_rms_epsilon") or 1e-5)

    def planned(name: str, source: str, zero: bool = False) -> PlannedTensor:
        kind = name.split(".")[-2]
        t = by_name[source]
        shape = _shape(kind, tuple(int(x) for x in reversed(t.shape.tolist())), new)

        def make() -> np.ndarray:
            if zero:
                return np.zeros(shape, np.float32)
            a = _as_f32(t).reshape(tuple(int(x) for x in reversed(t.shape.tolist())))
            return _pad(a * scale if kind in NORMS else a, shape)

        return PlannedTensor(name, shape, np.float32, make)

    plan = [planned(n, n) for n in ("token_embd.weight", "output_norm.weight", "output.weight") if n in by_name]
    for i in range(n_layer):
        j = i % n_src
        for t in reader.tensors:
            if t.name.startswith(f"blk.{j}."):
                rest = t.name[len(f"blk.{j}."):]
                silent = i >= n_src and rest in ("attn_output.weight", "ffn_down_exps.weight")
                plan.append(planned(f"blk.{i}.{rest}", t.name, zero=silent))
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(out, "llama")
    _copy_metadata(reader, writer)
    writer.add_name(f"{src.stem} widened {n_embd}x{n_ff_exp}x{n_layer}")
    writer.add_file_type(0)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(n_ff_exp)
    writer.add_block_count(n_layer)
    writer.add_head_count(new.n_head)
    writer.add_head_count_kv(new.n_head_kv)
    writer.add_layer_norm_rms_eps(eps * d / n_embd)
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
    path = widen_moe(args.src, args.out, n_embd=args.hidden, n_ff_exp=args.expert_width, n_layer=args.layers)
    print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB)")


if __name__ == "__main__":
    main()
