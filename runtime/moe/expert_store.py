"""Where offloaded experts live: mmap'd GGUF slices on disk, or host RAM; plus low-bit copies.

In llama.cpp's MoE layout each layer stores all its experts in one 3-D tensor per
projection with the expert index outermost, so expert ``e`` of ``blk.N.ffn_up_exps``
is one contiguous byte range of the file: :class:`GGUFExpertSource` maps it with numpy
and reads (and, for quantized types, dequantizes) only that range on a load. Every load
reports the bytes it read so benchmarks can count I/O per token.

:class:`LowBitExperts` holds the HOBBIT-style low-precision copies (4- or 8-bit,
per-row-group asymmetric, from :mod:`tandem.kernels.kv_quant`) in host RAM; they are
what a cache miss of a low-weight expert loads instead of the full-precision expert.
On a CUDA device the *packed* copy is what crosses PCIe and it is dequantized on the
GPU, so a low-bit miss moves about 1/7 of the bytes of an f32 one.

Host copies are page-locked (pinned) when CUDA is present: only then can a host-to-device
copy run asynchronously on a side stream while the GPU computes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import gguf
import numpy as np
import torch

from tandem.errors import UnsupportedModel
from tandem.kernels.kv_quant import QuantizedRows, dequantize, quantize
from tandem.models.gguf_file import inspect_gguf

PROJ = ("gate", "up", "down")


@dataclass(frozen=True)
class ExpertWeights:
    """One expert's SwiGLU matrices as torch expects them: gate/up (ff, d), down (d, ff)."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.gate, self.up, self.down))

    def to(self, device: torch.device, dtype: torch.dtype) -> ExpertWeights:
        nb = device.type == "cuda"
        return ExpertWeights(*(t.to(device=device, dtype=dtype, non_blocking=nb) for t in (self.gate, self.up, self.down)))


class ExpertSource(Protocol):
    n_layer: int
    n_experts: int

    def load(self, layer: int, expert: int) -> tuple[ExpertWeights, int]:
        """The expert's full-precision weights (host memory) and the bytes read to get them."""
        ...


class GGUFExpertSource:
    """Experts read on demand from the GGUF file through a read-only memory map."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        info = inspect_gguf(self.path)
        self.n_experts = int(info.arch_value("expert_count", 0) or 0)
        if not self.n_experts:
            raise UnsupportedModel(f"{self.path} is not a mixture-of-experts model (no expert_count).")
        self.n_layer = int(info.arch_value("block_count", 0))
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._tensors = {}
        for t in info.tensors:
            for p in PROJ:
                if t.name.endswith(f".ffn_{p}_exps.weight"):
                    layer = int(t.name.split(".")[1])
                    self._tensors[(layer, p)] = (info.data_offset + t.offset, t.nbytes, t.shape, t.ggml_type)
        missing = [(i, p) for i in range(self.n_layer) for p in PROJ if (i, p) not in self._tensors]
        if missing:
            raise UnsupportedModel(f"{self.path}: expert tensor ffn_{missing[0][1]}_exps of layer {missing[0][0]} is missing.")

    def load(self, layer: int, expert: int) -> tuple[ExpertWeights, int]:
        out, total = [], 0
        for p in PROJ:
            start, nbytes, shape, ggml_type = self._tensors[(layer, p)]
            per = nbytes // self.n_experts
            raw = np.array(self._map[start + expert * per : start + (expert + 1) * per])  # the read
            total += per
            rows, cols = int(shape[1]), int(shape[0])
            qtype = gguf.GGMLQuantizationType(ggml_type)
            if qtype == gguf.GGMLQuantizationType.F32:
                arr = raw.view(np.float32)
            elif qtype == gguf.GGMLQuantizationType.F16:
                arr = raw.view(np.float16)
            else:
                arr = gguf.quants.dequantize(raw.reshape(rows, -1), qtype)
            out.append(torch.from_numpy(np.ascontiguousarray(arr).reshape(rows, cols)))
        return ExpertWeights(*out), total


class RamExpertSource:
    """Experts held in host RAM as stacked (E, out, in) tensors (e.g. taken from a loaded model)."""

    def __init__(self, stacks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        self.stacks = [tuple(t.detach().cpu() for t in s) for s in stacks]
        self.n_layer = len(stacks)
        self.n_experts = int(stacks[0][0].shape[0])
        self.pin = torch.cuda.is_available()
        if self.pin:  # page-locked host memory makes host-to-device copies asynchronous
            self.stacks = [tuple(t.pin_memory() for t in s) for s in self.stacks]

    def load(self, layer: int, expert: int) -> tuple[ExpertWeights, int]:
        w = ExpertWeights(*(t[expert] for t in self.stacks[layer]))
        return w, w.nbytes


@dataclass(frozen=True)
class _LowBit:
    gate: QuantizedRows
    up: QuantizedRows
    down: QuantizedRows

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes


def _move(q: QuantizedRows, device: torch.device, pin: bool = False) -> QuantizedRows:
    """The same packed rows on ``device`` (asynchronous from pinned host memory)."""
    def mv(t: torch.Tensor) -> torch.Tensor:
        if device.type == "cpu":  # device-to-host stays blocking: the host copy is read at once
            t = t.to(device)
            return t.pin_memory() if pin else t
        return t.to(device, non_blocking=True)

    return replace(q, packed=mv(q.packed), scale=mv(q.scale), zero=mv(q.zero))


class LowBitExperts:
    """Low-precision copies of every expert, in host RAM, built once from a source.

    ``work_device`` only says where the quantization arithmetic runs (a GPU makes
    building the copies of a multi-GB model take seconds); the copies always end up in
    host RAM, pinned when CUDA is present.
    """

    GROUP = 32

    def __init__(self, source: ExpertSource, bits: int = 4, work_device: str | torch.device = "cpu") -> None:
        self.bits = bits
        self._copies: dict[tuple[int, int], _LowBit] = {}
        self._ff: dict[int, int] = {}
        self._dim: dict[int, int] = {}
        work, host = torch.device(work_device), torch.device("cpu")
        pin = torch.cuda.is_available()
        for layer in range(source.n_layer):
            for e in range(source.n_experts):
                w, _ = source.load(layer, e)
                self._ff[layer], self._dim[layer] = w.gate.shape[0], w.gate.shape[1]
                qs = (self._quant(t.to(work)) for t in (w.gate, w.up, w.down))
                self._copies[(layer, e)] = _LowBit(*(_move(q, host, pin) for q in qs))

    def _quant(self, t: torch.Tensor) -> QuantizedRows:
        """Rows in groups of 32 columns; odd widths are zero-padded (sliced off on load)."""
        pad = -t.shape[1] % self.GROUP
        return quantize(torch.nn.functional.pad(t.float(), (0, pad)), self.bits, self.GROUP)

    def load(self, layer: int, expert: int, device: torch.device | None = None) -> tuple[ExpertWeights, int]:
        """Dequantized weights on ``device`` (host when None) and the packed bytes moved.

        On a GPU the packed bytes are copied (on the caller's current stream) and
        dequantized there: the transfer is the cost being saved.
        """
        c = self._copies[(layer, expert)]
        parts = (c.gate, c.up, c.down)
        if device is not None and device.type != "cpu":
            parts = tuple(_move(q, device) for q in parts)
        gate, up, down = (dequantize(q) for q in parts)
        ff, dim = self._ff[layer], self._dim[layer]
        return ExpertWeights(gate[:, :dim], up[:, :dim], down[:, :ff]), c.nbytes
