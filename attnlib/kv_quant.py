"""Quantising the KV cache, derived in chapter 23: int-n per group, and its true bytes.

A group is n_group consecutive numbers along one axis: along the features of a token ("per
token") or along the tokens of one feature ("per channel", KIVI's keys). Each group stores its
step (and, asymmetric, its offset, the smallest number) as metadata, eq. 23.10; eq. 23.11
counts the bits.
The functions return the dequantised tensor (what attention then reads), in x's dtype.
"""

import torch


def _levels(bits: int, symmetric: bool) -> int:
    if not isinstance(bits, int) or not 1 <= bits <= 16 or (symmetric and bits < 2):
        raise ValueError(f"bits must be a whole number in 2..16 (1..16 asymmetric), got {bits}")
    return 2 ** (bits - 1) - 1 if symmetric else 2**bits - 1


def _groups(x: torch.Tensor, axis: int, group: int) -> torch.Tensor:
    """x with `axis` moved last and cut into groups: [..., n / group, group]."""
    moved = x.movedim(axis, -1)
    if group < 1 or moved.shape[-1] % group:
        raise ValueError(f"group ({group}) must divide the axis' length ({moved.shape[-1]})")
    return moved.reshape(*moved.shape[:-1], moved.shape[-1] // group, group)


def quantize(
    x: torch.Tensor, bits: int, group: int, axis: int = -1, symmetric: bool = False
) -> torch.Tensor:
    """Eq. 23.10, round to the nearest of 2^bits levels per group, then back to x's dtype.

    symmetric: levels step * {-(2^(bits-1) - 1), ..., 2^(bits-1) - 1}, step = max|x| / that top.
    asymmetric: levels low + step * {0, ..., 2^bits - 1}, low = min x, step = (max x - min x)
    / (2^bits - 1). Groups of `group` numbers along `axis`; ties round to even."""
    levels = _levels(bits, symmetric)
    g = _groups(x, axis, group).double()
    if symmetric:
        step = g.abs().amax(-1, keepdim=True) / levels
        codes = torch.round(g / step.clamp_min(1e-300)).clamp(-levels, levels)
        out = codes * step
    else:
        low = g.amin(-1, keepdim=True)
        step = (g.amax(-1, keepdim=True) - low) / levels
        codes = torch.round((g - low) / step.clamp_min(1e-300)).clamp(0, levels)
        out = low + codes * step
    moved_shape = x.movedim(axis, -1).shape
    return out.reshape(moved_shape).movedim(-1, axis).to(x.dtype)


def bits_per_number(bits: int, group: int, symmetric: bool = False, meta_bits: int = 16) -> float:
    """Eq. 23.11: bits + (1 or 2 metadata numbers of meta_bits) / group, per cached number."""
    _levels(bits, symmetric)
    return bits + meta_bits * (1 if symmetric else 2) / group


def bytes_per_token(
    numbers: int, bits: int, group: int, symmetric: bool = False, meta_bits: int = 16
) -> float:
    """Bytes one token's `numbers` cached numbers take, metadata included (eq. 23.11)."""
    return numbers * bits_per_number(bits, group, symmetric, meta_bits) / 8


def fp8_roundtrip(x: torch.Tensor, dtype=torch.float8_e4m3fn) -> torch.Tensor:
    """x cast to an 8-bit float (e4m3: 4 exponent bits, 3 mantissa bits) and back, with one
    scale per tensor so that the largest |x| lands on e4m3's largest number, 448."""
    top = torch.finfo(dtype).max
    scale = x.abs().max().clamp_min(1e-30) / top
    return ((x / scale).to(dtype).to(x.dtype)) * scale
