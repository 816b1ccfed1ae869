"""Per-token-group asymmetric low-bit quantization with bit packing (4-bit and 2-bit KV).

Each row (one token's K or V vector) is cut into groups of ``group`` channels; every
group stores its minimum and step in float16 and its values as unsigned integers of
``bits`` bits, packed several per byte. Asymmetric min/max is what RotateKV uses for KV:
after a Hadamard rotation the groups are close to Gaussian, so the range is tight.

Round-trip error bound: every value is within half a step of its original,
``|x - deq(q(x))| <= (max - min) / (2**bits - 1) / 2`` per group (plus float16 rounding
of the scale and minimum).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_BITS = (2, 4, 8)


@dataclass(frozen=True)
class QuantizedRows:
    """Packed low-bit rows: ``packed`` uint8 (..., n_groups, group*bits/8), ``scale``/``zero`` fp16."""

    packed: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group: int
    width: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.zero))


def bytes_per_row(width: int, bits: int, group: int) -> int:
    """Bytes one quantized row of ``width`` channels takes (codes plus fp16 scale and zero)."""
    n_groups = -(-width // group)
    return n_groups * (group * bits // 8 + 4)


def _check(width: int, bits: int, group: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    if group <= 0 or width % group or (group * bits) % 8:
        raise ValueError(f"group {group} must divide the row width {width} and fill whole bytes")


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes (< 2**bits, last dim a multiple of 8/bits) into uint8, low bits first."""
    per = 8 // bits
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    out = torch.zeros(c.shape[:-1], dtype=torch.uint8, device=codes.device)
    for i in range(per):
        out |= c[..., i] << (i * bits)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: uint8 bytes back to one code per element (uint8)."""
    per = 8 // bits
    if per == 1:
        return packed
    mask = (1 << bits) - 1
    parts = [packed & mask, *((packed >> (i * bits)) & mask for i in range(1, per - 1)), packed >> ((per - 1) * bits)]
    return torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * per)


def quantize(x: torch.Tensor, bits: int, group: int) -> QuantizedRows:
    """Quantize the last dimension of ``x`` in groups of ``group`` channels (asymmetric min/max)."""
    width = x.shape[-1]
    _check(width, bits, group)
    levels = (1 << bits) - 1
    g = x.float().reshape(*x.shape[:-1], width // group, group)
    lo = g.amin(dim=-1, keepdim=True).half()
    hi = g.amax(dim=-1, keepdim=True)
    step = ((hi - lo.float()) / levels).half()
    # A constant group has step 0: any code decodes to lo exactly.
    safe = torch.where(step.float() > 0, step.float(), torch.ones_like(step.float()))
    codes = torch.round((g - lo.float()) / safe).clamp_(0, levels)
    return QuantizedRows(pack(codes, bits), step.squeeze(-1), lo.squeeze(-1), bits, group, width)


def dequantize(q: QuantizedRows, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode :class:`QuantizedRows` back to ``dtype`` rows of the original width."""
    codes = unpack(q.packed, q.bits).float()
    out = codes * q.scale.float().unsqueeze(-1) + q.zero.float().unsqueeze(-1)
    return out.reshape(*out.shape[:-2], q.width).to(dtype)


def max_error_bound(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Per-group worst-case round-trip error: half a step plus fp16 rounding of min and step."""
    g = x.float().reshape(*x.shape[:-1], x.shape[-1] // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    step = (hi - lo) / ((1 << bits) - 1)
    fp16_eps = 2.0**-10
    slack = fp16_eps * (lo.abs() + step * ((1 << bits) - 1)) + 1e-7
    return step / 2 + slack


def quantize_channels(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KIVI-style per-channel quantization of a block of tokens ``x`` (n, width).

    Keys have a few channels that are large for *every* token (outlier channels), so a
    per-token group wastes its range on them; one min/step per channel over a group of
    tokens fits each channel's own range instead (KIVI, Liu et al. 2024). Returns
    ``(packed (n, width*bits/8) uint8, step (width,) fp16, lo (width,) fp16)``; each
    token's codes stay a separate row, so tokens can later be dropped from the group
    (eviction, rollback) without touching the others.
    """
    width = x.shape[-1]
    _check(width, bits, width)
    levels = (1 << bits) - 1
    g = x.float()
    lo = g.amin(dim=0).half()
    step = ((g.amax(dim=0) - lo.float()) / levels).half()
    safe = torch.where(step.float() > 0, step.float(), torch.ones_like(step.float()))
    codes = torch.round((g - lo.float()) / safe).clamp_(0, levels)
    return pack(codes, bits), step, lo


def dequantize_channels(
    packed: torch.Tensor, bits: int, step: torch.Tensor, lo: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Decode rows of :func:`quantize_channels`; ``step``/``lo`` are per row (n, width) or shared (width,)."""
    return (unpack(packed, bits).to(dtype) * step.to(dtype) + lo.to(dtype)).to(dtype)


def channel_group_bytes(width: int) -> int:
    """Bytes of one per-channel token group's parameters: fp16 step and minimum per channel."""
    return 4 * width
