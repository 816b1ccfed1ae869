"""`tandem moefy SRC -o OUT.gguf --experts E --top-k K`: a real MoE GGUF from a dense model.

Calibration runs the dense model in the torch engine on text (a file, or stories the
model samples itself from its BOS token) and records every layer's FFN input, which is
what the routers are trained on (see :mod:`tandem.models.moefy`).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tandem.app.progress import Progress
from tandem.errors import TandemError
from tandem.models.extras import require

if TYPE_CHECKING:  # torch is imported where moefy runs: `tandem` loads every command module
    import torch


@dataclass(frozen=True)
class MoefyReport:
    path: Path
    n_experts: int
    top_k: int
    calib_tokens: int
    router_recall: list[float]
    ffn_rel_error: list[float]

    def __str__(self) -> str:
        rec = ", ".join(f"{r:.2f}" for r in self.router_recall)
        err = ", ".join(f"{e:.2f}" for e in self.ffn_rel_error)
        return (f"wrote {self.path}: {self.n_experts} experts, top-{self.top_k}, routers trained on "
                f"{self.calib_tokens} tokens; held-out router recall per layer [{rec}], "
                f"FFN relative error per layer [{err}]")


@contextlib.contextmanager
def _record_ffn_inputs(n_layer: int) -> Iterator[list[list[torch.Tensor]]]:
    """Capture each dense layer's FFN input (post-norm hidden state) during forward passes."""
    # local: `tandem --help` imports every command module; this loads only when the command runs
    import tandem.runtime.backends.torch_engine.decoder as llama

    seen: list[list[torch.Tensor]] = [[] for _ in range(n_layer)]
    original = llama.swiglu
    calls = [0]

    def spy(x, gate, up, down):
        seen[calls[0] % n_layer].append(x.detach().float().cpu())
        calls[0] += 1
        return original(x, gate, up, down)

    llama.swiglu = spy
    try:
        yield seen
    finally:
        llama.swiglu = original


def calibration_inputs(src: Path, text: str | None, n_tokens: int, seed: int = 0) -> list[np.ndarray]:
    """Per layer (N, d) FFN inputs from running the dense model on ``text`` or its own samples."""
    import torch  # local: the [torch] extra, seconds to import

    from tandem.runtime.backends.torch_engine.backend import TorchBackend, TorchConfig

    threads = torch.get_num_threads()
    # One-token steps of a small model: one thread avoids oversubscription on busy machines.
    b = TorchBackend(src, TorchConfig(device="cpu", n_threads=1))
    n_layer = b.model_config.n_layer
    rng = np.random.default_rng(seed)
    with _record_ffn_inputs(n_layer) as seen:
        if text:
            ids = b.tokenize(text, add_bos=True)[: b.n_ctx]
            for start in range(0, len(ids), b.n_ctx):
                b.truncate(0)
                b.evaluate(ids[start : start + b.n_ctx])
        else:  # sample stories at temperature 1 from BOS until n_tokens are seen
            bos = b.special.bos if b.special.bos is not None else 0
            total = 0
            while total < n_tokens:
                b.truncate(0)
                logits = b.evaluate([bos])[-1]
                for _ in range(min(256, b.n_ctx - 1)):
                    p = np.exp(logits - logits.max())
                    t = int(rng.choice(len(p), p=p / p.sum()))
                    total += 1
                    if t in b.special.eog or total >= n_tokens:
                        break
                    logits = b.evaluate([t])[-1]
    b.close()
    torch.set_num_threads(threads)
    return [torch.cat(layer).numpy() for layer in seen]


def moefy_file(
    src: Path, out: Path, n_experts: int, top_k: int, *, text: str | None = None, n_tokens: int = 2048, seed: int = 0
) -> MoefyReport:
    # local: `tandem --help` imports every command module; this loads only when the command runs
    from tandem.models.moefy import MoefyConfig, moefy_layer, read_dense_ffns, write_moe_gguf

    if n_experts < 2:
        raise TandemError("moefy needs at least 2 experts.")
    if not 1 <= top_k <= n_experts:
        raise TandemError(f"--top-k must be between 1 and --experts ({n_experts}), got {top_k}.")
    reader, dense = read_dense_ffns(src)
    if n_experts > dense[0].gate.shape[0]:
        raise TandemError(f"{src} has only {dense[0].gate.shape[0]} FFN neurons per layer: fewer than {n_experts} experts.")
    xs = calibration_inputs(src, text, n_tokens, seed)
    cfg = MoefyConfig(n_experts=n_experts, top_k=top_k, seed=seed)
    layers = [moefy_layer(f, x, cfg, i) for i, (f, x) in enumerate(zip(dense, xs, strict=True))]
    extra = {"source": src.name, "method": "balanced k-means on [gate;up] rows + linear router (BCE, top-k)"}
    write_moe_gguf(reader, layers, out, top_k, extra=extra)
    return MoefyReport(out, n_experts, top_k, int(xs[0].shape[0]),
                       [lay.stats["router_recall"] for lay in layers], [lay.stats["ffn_rel_error"] for lay in layers])


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("moefy", help="split a dense Llama GGUF into a mixture-of-experts GGUF (MoEfication)")
    p.add_argument("src", type=Path, help="dense Llama-architecture GGUF")
    p.add_argument("-o", "--out", type=Path, required=True, help="output GGUF (llama.cpp MoE layout)")
    p.add_argument("--experts", type=int, default=8, help="experts per layer (default 8)")
    p.add_argument("--top-k", type=int, default=2, help="experts used per token (default 2)")
    p.add_argument("--text", type=Path, default=None, help="calibration text file (default: the model's own samples)")
    p.add_argument("--calib-tokens", type=int, default=2048, help="tokens to sample when no --text is given")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    require("tandem moefy", "torch", "torch")  # calibration runs the dense model in the torch engine
    text = None
    if args.text is not None:
        try:
            text = args.text.read_text(encoding="utf-8")
        except OSError as exc:
            raise TandemError(f"Cannot read calibration text {args.text}: {exc.strerror}.") from None
    with Progress(f"splitting {args.src.name} into experts"):
        report = moefy_file(args.src, args.out, args.experts, args.top_k, text=text,
                            n_tokens=args.calib_tokens, seed=args.seed)
    print(report, file=sys.stdout)
    return 0
