"""Bit-packing of boolean masks: 8 elements per byte.

``pack_bits(mask)`` flattens ``mask`` in logical (row-major) order, whatever its strides, and
returns a 1-D ``uint8`` tensor of ``ceil(numel / 8)`` bytes on the same device: element ``i`` is bit
``i % 8`` (least significant first) of byte ``i // 8``; padding bits are 0. ``unpack_bits(packed,
numel)`` inverts it and returns a 1-D ``bool`` tensor of ``numel`` elements, to be reshaped by the
caller. Round trip is exact for any shape, including zero-size tensors. Used by the output-based
activations (branch bits) and usable by dropout (the keep mask kept at 1 bit per element instead of
eager's 4 B float mask on CPU).
"""

from __future__ import annotations

import torch

__all__ = ["pack_bits", "packed_numel", "unpack_bits", "unpack_bits_as"]

_WEIGHTS: dict[torch.device, torch.Tensor] = {}
_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _weights(device: torch.device) -> torch.Tensor:
    w = _WEIGHTS.get(device)
    if w is None:
        w = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)
        _WEIGHTS[device] = w
    return w


def _shifts(device: torch.device) -> torch.Tensor:
    s = _SHIFTS.get(device)
    if s is None:
        s = torch.arange(8, dtype=torch.uint8, device=device)
        _SHIFTS[device] = s
    return s


def packed_numel(numel: int) -> int:
    """Bytes needed to pack ``numel`` bits."""
    return (numel + 7) // 8


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Pack a boolean tensor into a 1-D uint8 tensor, 8 elements per byte (LSB first).

    Args:
        mask: boolean tensor of any shape and strides.

    Returns:
        1-D uint8 tensor of ``ceil(mask.numel() / 8)`` bytes.
    """
    flat = mask.reshape(-1)
    n = flat.numel()
    pad = (-n) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    byte = flat.view(torch.uint8).view(-1, 8) * _weights(flat.device)
    return byte.sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: a 1-D bool tensor of ``numel`` elements."""
    return unpack_bits_as(packed, numel, torch.bool)


def unpack_bits_as(packed: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Like :func:`unpack_bits` but returns 0/1 in ``dtype`` (e.g. float32 for arithmetic
    blending)."""
    bits = (packed.unsqueeze(1) >> _shifts(packed.device)) & 1
    return bits.reshape(-1)[:numel].to(dtype)
