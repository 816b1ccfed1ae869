"""MoEfication: turn a dense Llama GGUF into a mixture-of-experts GGUF in llama.cpp's layout.

There are no small public MoE models to test expert offloading on, so we make one
honestly from a dense model (Zhang et al., "MoEfication", 2022):

1. **Split** each layer's FFN neurons into ``E`` equal groups by balanced k-means on the
   normalized ``[gate; up]`` weight rows (neurons with similar input directions fire
   together). Each group is an expert; the sum over all experts is exactly the dense FFN.
   Groups are padded with zero neurons when ``E`` does not divide the FFN width
   (``silu(0) * 0 = 0``: padding contributes nothing).
2. **Route**: a linear router per layer (no bias, llama.cpp's ``ffn_gate_inp``), trained on
   FFN inputs collected by running the dense model on text, to predict which experts
   contribute most (largest output norm) for each token: input-dependent routing.
3. **Write** a GGUF with ``llama.expert_count``, ``llama.expert_used_count`` and the
   ``blk.N.ffn_{gate_inp,gate_exps,up_exps,down_exps}.weight`` tensors, all other tensors
   and metadata copied.

llama.cpp mixes the chosen experts with softmax weights renormalized over the top-k,
whereas MoEfication sums them with weight 1. We scale the router so its logits are small
(top-k weights close to ``1/k``) and multiply ``ffn_down_exps`` by ``k``: the selected
experts then enter with weight close to 1 and the ranking (which only needs the sign of
logit differences) is unchanged. ``router_scale=0`` makes the weights exactly ``1/k``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch

from tandem.errors import ModelFormatError, TandemError, UnsupportedModel


@dataclass(frozen=True)
class MoefyConfig:
    n_experts: int = 8
    top_k: int = 2
    kmeans_iters: int = 12
    router_steps: int = 300
    router_lr: float = 1e-2
    router_logit_std: float = 0.05
    """Target spread of the written router logits: small keeps top-k weights near 1/k."""
    seed: int = 0


@dataclass
class DenseFFN:
    """One layer's SwiGLU FFN, numpy rows as stored: gate/up (ff, d), down (d, ff)."""

    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray


@dataclass
class MoELayer:
    """One layer's experts: gate/up (E, ff_e, d), down (E, d, ff_e), router (E, d)."""

    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray
    router: np.ndarray
    groups: list[np.ndarray]
    stats: dict[str, float] = field(default_factory=dict)


def read_dense_ffns(path: str | os.PathLike[str]) -> tuple[gguf.GGUFReader, list[DenseFFN]]:
    """Open a dense Llama GGUF and dequantize every layer's FFN weights to float32."""
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise ModelFormatError(f"Cannot read {path} as GGUF: {exc}") from None
    arch = reader.fields.get("general.architecture")
    if arch is None or arch.contents() != "llama":
        raise UnsupportedModel(f"{path}: moefy needs a dense Llama-architecture GGUF.")
    if "llama.expert_count" in reader.fields:
        raise UnsupportedModel(f"{path} is already a mixture-of-experts model.")
    tensors = {t.name: t for t in reader.tensors}
    n_layer = int(reader.fields["llama.block_count"].contents())
    layers = []
    for i in range(n_layer):
        try:
            gate, up, down = (_f32(tensors[f"blk.{i}.ffn_{n}.weight"]) for n in ("gate", "up", "down"))
        except KeyError as exc:
            raise UnsupportedModel(f"{path}: layer {i} has no SwiGLU FFN tensor {exc}.") from None
        layers.append(DenseFFN(gate, up, down))
    return reader, layers


def _f32(t: gguf.ReaderTensor) -> np.ndarray:
    data = gguf.quants.dequantize(t.data, t.tensor_type)
    rows = [int(x) for x in reversed(t.shape.tolist())]
    return np.ascontiguousarray(data.reshape(rows), dtype=np.float32)


def balanced_kmeans(features: np.ndarray, n_clusters: int, iters: int, seed: int) -> list[np.ndarray]:
    """Cluster rows into ``n_clusters`` groups of (almost) equal size, ``ceil(n/k)`` at most.

    Assignment is greedy by distance under a capacity limit, which keeps the experts the
    same width (llama.cpp stores all experts of a layer in one 3-D tensor).
    """
    n = features.shape[0]
    cap = -(-n // n_clusters)
    rng = np.random.default_rng(seed)
    centers = features[rng.choice(n, size=n_clusters, replace=n < n_clusters)]
    assign = np.zeros(n, dtype=np.int64)
    for _ in range(max(1, iters)):
        dist = ((features[:, None, :] - centers[None, :, :]) ** 2).sum(-1)
        order = np.argsort(dist, axis=None, kind="stable")
        count = np.zeros(n_clusters, dtype=np.int64)
        done = np.zeros(n, dtype=bool)
        for flat in order:
            row, c = divmod(int(flat), n_clusters)
            if not done[row] and count[c] < cap:
                assign[row], done[row] = c, True
                count[c] += 1
        for c in range(n_clusters):
            members = features[assign == c]
            if len(members):
                centers[c] = members.mean(0)
    return [np.flatnonzero(assign == c) for c in range(n_clusters)]


def _fill_dead(groups: list[np.ndarray], live: np.ndarray, dead: np.ndarray, width: int) -> list[np.ndarray]:
    """Map clustered live-neuron groups back to neuron ids and top them up with dead (all-zero) neurons.

    Cost twins pad the FFN with all-zero neurons; clustering those would put every real
    neuron into one expert. Instead the real neurons are clustered alone and the zero
    ones (which output exactly 0) fill the experts up to a common width, so a twin's
    experts have the twin's size and the source model's routing.
    """
    out, rest = [], list(dead)
    for g in groups:
        ids = live[g].tolist()
        take = max(0, width - len(ids))
        out.append(np.array(sorted(ids + rest[:take]), dtype=np.int64))
        rest = rest[take:]
    return out


def split_experts(ffn: DenseFFN, groups: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Expert tensors from neuron groups, zero-padded to a common width."""
    width = max(len(g) for g in groups)
    e, d = len(groups), ffn.gate.shape[1]
    gate = np.zeros((e, width, d), np.float32)
    up = np.zeros((e, width, d), np.float32)
    down = np.zeros((e, d, width), np.float32)
    for j, g in enumerate(groups):
        gate[j, : len(g)] = ffn.gate[g]
        up[j, : len(g)] = ffn.up[g]
        down[j, :, : len(g)] = ffn.down[:, g]
    return gate, up, down


def expert_outputs(x: torch.Tensor, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> torch.Tensor:
    """Every expert's output for every row of ``x``: (N, E, d)."""
    g, u, dn = (torch.from_numpy(a) for a in (gate, up, down))
    h = torch.nn.functional.silu(torch.einsum("nd,efd->nef", x, g)) * torch.einsum("nd,efd->nef", x, u)
    return torch.einsum("nef,edf->ned", h, dn)


def train_router(x: torch.Tensor, scores: torch.Tensor, top_k: int, cfg: MoefyConfig) -> torch.Tensor:
    """Linear router (E, d) trained with BCE to flag each token's top-k experts by ``scores``."""
    n_exp = scores.shape[1]
    target = torch.zeros_like(scores)
    target.scatter_(1, scores.topk(top_k, dim=1).indices, 1.0)
    gen = torch.Generator().manual_seed(cfg.seed)
    w = (torch.randn(n_exp, x.shape[1], generator=gen) * 0.01).requires_grad_(True)
    opt = torch.optim.Adam([w], lr=cfg.router_lr)
    xs = x / x.norm(dim=1, keepdim=True).mean()
    for _ in range(cfg.router_steps):
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(xs @ w.T, target)
        loss.backward()
        opt.step()
    return (w.detach() / x.norm(dim=1, keepdim=True).mean()).float()


def router_recall(router: torch.Tensor, x: torch.Tensor, scores: torch.Tensor, top_k: int) -> float:
    """Fraction of the oracle top-k experts (by output norm) that the router also picks."""
    picked = (x @ router.T).topk(top_k, dim=1).indices
    oracle = scores.topk(top_k, dim=1).indices
    hits = (picked.unsqueeze(2) == oracle.unsqueeze(1)).any(2).float().sum()
    return float(hits / oracle.numel())


def moefy_layer(ffn: DenseFFN, x: np.ndarray, cfg: MoefyConfig, layer_seed: int) -> MoELayer:
    """Split one dense FFN into experts and train its router on FFN inputs ``x`` (N, d)."""
    feats = np.concatenate((ffn.gate, ffn.up), axis=1)
    norms = np.linalg.norm(feats, axis=1)
    feats = feats / np.maximum(norms[:, None], 1e-12)
    live = np.flatnonzero(norms > 0)
    if len(live):
        groups = balanced_kmeans(feats[live].astype(np.float64), cfg.n_experts, cfg.kmeans_iters, cfg.seed + layer_seed)
    else:  # an all-zero FFN (a twin's identity layer): every expert outputs 0
        groups = [np.zeros(0, dtype=np.int64) for _ in range(cfg.n_experts)]
    groups = _fill_dead(groups, live, np.flatnonzero(norms == 0), -(-len(norms) // cfg.n_experts))
    gate, up, down = split_experts(ffn, groups)
    xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    outs = expert_outputs(xt, gate, up, down)
    scores = outs.norm(dim=-1)
    n = xt.shape[0]
    n_train = max(1, int(n * 0.8))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed + layer_seed))
    tr, ho = perm[:n_train], perm[n_train:] if n - n_train > 0 else perm[:n_train]
    router = train_router(xt[tr], scores[tr], cfg.top_k, cfg)
    logits = xt @ router.T
    std = float(logits.std()) or 1.0
    router = router * (cfg.router_logit_std / std)
    dense = outs.sum(1)
    sel = (xt[ho] @ router.T).topk(cfg.top_k, dim=1).indices
    approx = torch.gather(outs[ho], 1, sel.unsqueeze(-1).expand(-1, -1, outs.shape[-1])).sum(1)
    rel = float((approx - dense[ho]).norm() / dense[ho].norm().clamp_min(1e-12))
    stats = {"router_recall": router_recall(router, xt[ho], scores[ho], cfg.top_k), "ffn_rel_error": rel}
    return MoELayer(gate, up, down, router.numpy(), groups, stats)


def write_moe_gguf(
    reader: gguf.GGUFReader,
    layers: Sequence[MoELayer],
    out: str | os.PathLike[str],
    top_k: int,
    router_scale: float = 1.0,
    extra: dict[str, str] | None = None,
) -> Path:
    """Write ``reader``'s model with its FFNs replaced by ``layers`` in llama.cpp's MoE layout."""
    out = Path(out)
    n_exp, width = layers[0].gate.shape[0], layers[0].gate.shape[1]
    if not 1 <= top_k <= n_exp:
        raise TandemError(f"top-k must be between 1 and the number of experts ({n_exp}), got {top_k}.")
    writer = gguf.GGUFWriter(str(out), "llama")
    replaced = {"llama.feed_forward_length", "llama.expert_count", "llama.expert_used_count"}
    for f in reader.fields.values():
        if f.name == "general.architecture" or f.name.startswith("GGUF.") or f.name in replaced:
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, f.contents(), vtype, sub_type=sub)
    writer.add_feed_forward_length(width)
    writer.add_expert_count(n_exp)
    writer.add_expert_used_count(top_k)
    for key, value in (extra or {}).items():
        writer.add_string(f"tandem.moefy.{key}", value)
    dense_names = {f"blk.{i}.ffn_{n}.weight" for i in range(len(layers)) for n in ("gate", "up", "down")}
    by_layer: dict[int, list[tuple[str, np.ndarray]]] = {}
    for i, lay in enumerate(layers):
        by_layer[i] = [
            (f"blk.{i}.ffn_gate_inp.weight", (lay.router * router_scale).astype(np.float32)),
            (f"blk.{i}.ffn_gate_exps.weight", lay.gate),
            (f"blk.{i}.ffn_up_exps.weight", lay.up),
            (f"blk.{i}.ffn_down_exps.weight", (lay.down * top_k).astype(np.float32)),
        ]
    for t in reader.tensors:
        if t.name in dense_names:
            if t.name.endswith("ffn_down.weight"):
                layer = int(t.name.split(".")[1])
                for name, arr in by_layer[layer]:
                    writer.add_tensor(name, np.ascontiguousarray(arr))
            continue
        writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
