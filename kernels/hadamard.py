"""Fast Walsh–Hadamard transform (orthonormal) for rotating KV vectors before quantization.

A Hadamard rotation spreads a few large ("outlier") channels over all channels, so a
per-group min/max quantizer wastes far less of its range on them (RotateKV, QuaRot).
The normalized transform ``H/sqrt(n)`` is orthonormal and symmetric, hence its own
inverse: ``fwht(fwht(x)) == x`` and dot products are preserved, ``(Hq)·(Hk) == q·k``.

Lengths that are not a power of two are rotated block-diagonally with the largest
power-of-two block that divides them (still orthonormal, just less mixing).
"""

from __future__ import annotations

import math

import torch


def pow2_block(n: int) -> int:
    """Largest power of two dividing ``n`` (the Hadamard block size used for length ``n``)."""
    if n <= 0:
        raise ValueError(f"length must be positive, got {n}")
    return n & -n


def fwht(x: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """Orthonormal Walsh–Hadamard transform of the last dimension, in O(n log n).

    ``block`` (a power of two dividing the last dimension) rotates each block of that
    many channels separately; the default is :func:`pow2_block` of the length.
    """
    n = x.shape[-1]
    b = pow2_block(n) if block is None else block
    if b & (b - 1) or n % b:
        raise ValueError(f"block {b} must be a power of two dividing {n}")
    lead = x.shape[:-1]
    y = x.reshape(-1, n // b, b)
    h = 1
    while h < b:
        y = y.reshape(-1, n // b, b // (2 * h), 2, h)
        a, c = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + c, a - c), dim=-2)
        h *= 2
    return (y.reshape(*lead, n) * (1.0 / math.sqrt(b))).to(x.dtype)


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The explicit orthonormal (block) Hadamard matrix that :func:`fwht` applies (tests, calibration)."""
    return fwht(torch.eye(n, dtype=dtype))


def balanced_permutation(channel_scale: torch.Tensor, block: int) -> torch.Tensor:
    """Channel order that deals outlier channels evenly over Hadamard blocks.

    RotateKV reorders channels before a blockwise rotation so that no block gets
    several outliers. Channels are sorted by calibrated magnitude and dealt round-robin,
    so block ``j`` receives ranks ``j, j + n_blocks, ...``. Returns the permutation
    ``perm`` to apply as ``x[..., perm]`` (invert with ``torch.argsort(perm)``).
    """
    n = channel_scale.shape[-1]
    if n % block:
        raise ValueError(f"block {block} must divide {n}")
    n_blocks = n // block
    order = torch.argsort(channel_scale.abs(), descending=True)
    return order.reshape(block, n_blocks).T.reshape(-1)


def rotation_matrix(
    n: int, block: int | None = None, perm: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Orthonormal (n, n) matrix ``M`` with ``x @ M == fwht(x[..., perm], block)``.

    Folding the channel reordering and the blockwise Hadamard transform into one dense
    matrix turns ~3 log2(block) small tensor ops per call into one matmul, which is what
    dominates for the narrow rows (32-64 channels) of small models; ``x @ M.T`` undoes it.
    """
    eye = torch.eye(n, dtype=torch.float64)
    if perm is not None:
        if sorted(perm.tolist()) != list(range(n)):
            raise ValueError("perm must be a permutation of range(n)")
        eye = eye[:, perm]
    return fwht(eye, block).to(dtype)
