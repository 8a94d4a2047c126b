"""Bit-packing of boolean masks: 8 elements per byte (the one implementation slimgrad uses).

``pack_bits(mask)`` flattens ``mask`` in logical (row-major) order, whatever its strides, and
returns a 1-D ``uint8`` tensor of ``ceil(numel / 8)`` bytes on the same device: element ``i`` is bit
``i % 8`` (least significant first) of byte ``i // 8``; padding bits are 0. ``unpack_bits(packed,
numel)`` inverts it and returns a 1-D ``bool`` tensor of ``numel`` elements, to be reshaped by the
caller. Round trip is exact for any shape, including zero-size tensors. Used by the output-based
activations (branch bits), leaky_relu/elu/hardtanh (side bits) and dropout (the keep mask, 1 bit per
element instead of eager's 4 B float mask on CPU). The C kernels (``kernels/cpu/*.c``) write and
read the same layout.

# NOTE [Bit packing with one multiply]
Eight 0/1 bytes read as one little-endian int64 x = sum_i b_i 2^(8i). Multiplying by
M = 0x0102040810204080 (byte j of M is 2^(7-j)) puts b_i at bit 56 + i with no carries (every
product bit lands on a distinct position below bit 64 or is dropped by the 64-bit wrap), so
(x * M) >> 56 & 0xFF = sum_i b_i 2^i: one int64 multiply per 8 elements instead of shifts and a
reduction. Unpacking looks up each byte in a 256-entry table of int64 "spread" bytes (byte i of
entry v is bit i of v). Tested for every byte value and for lengths that are not multiples of 8.
"""

from __future__ import annotations

import sys

import torch

__all__ = [
    "pack_bits",
    "pack_nonzero",
    "packed_numel",
    "unpack_bits",
    "unpack_bits_as",
    "unpack_mask",
]

PACK_MUL = 0x0102040810204080
_SPREAD: dict[torch.device, torch.Tensor] = {}
_SHIFTS: dict[torch.device, torch.Tensor] = {}  # unpack_mask's 0..7 (uint8), per device


def packed_numel(numel: int) -> int:
    """Bytes needed to pack ``numel`` bits."""
    return (numel + 7) // 8


# NOTE [Bit tables outside every step]
# The unpacking tables (``unpack_bits``'s 256 int64 rows, ``unpack_mask``'s eight shifts) depend
# only on the device: they are built once per device and cached, with the dispatch modes set
# aside (as slimgrad/_math/smooth.py builds its tables), so they are process constants, never part
# of a step that ``slimgrad.memory.measure`` or ``estimate`` counts. Built inside the step instead,
# a real first step counted the 2,048 B table as made and kept (by the cache) while the estimate,
# whose fake tensors never used the cache, made it and freed it after one use: timm
# mobilenetv3_large_100's small bench model (first step of a process) estimated 2,048 B below the
# real step's peak. Fake tensors of a mode that takes real inputs (``memory.estimate``'s) read the
# same cached real tables, on CPU (the device every estimate runs on). Other fake tensors, and
# torch.compile's tracing, build a table for the call as before; without the private
# ``_disable_current_modes`` real tensors cache a table made in whichever step first needs it.
try:
    from torch.utils._python_dispatch import _disable_current_modes as _modes_aside
except ImportError:  # pragma: no cover - depends on the torch release
    _modes_aside = None


def _table(cache: dict, like: torch.Tensor, build) -> torch.Tensor:
    # NOTE [Bit tables outside every step]: ``build(device)`` once per device, outside the modes
    device = like.device
    if type(like) is not torch.Tensor and not (
        _modes_aside is not None
        and device.type == "cpu"
        and getattr(getattr(like, "fake_mode", None), "allow_non_fake_inputs", False)
    ):
        return build(device)  # another fake tensor: no real table in its ops
    t = cache.get(device)
    if t is None:
        if _modes_aside is None or torch.compiler.is_compiling():
            t = build(device)
            if type(like) is torch.Tensor and type(t) is torch.Tensor:
                cache[device] = t
            return t
        with _modes_aside():
            t = build(device)
        cache[device] = t
    return t


def _build_spread(device: torch.device) -> torch.Tensor:
    v = torch.arange(256, dtype=torch.int64, device=device)
    bits = (v.unsqueeze(1) >> torch.arange(8, device=device)) & 1  # bit i of v in byte i
    return bits.to(torch.uint8).view(torch.int64).reshape(256)


def _build_shifts(device: torch.device) -> torch.Tensor:
    return torch.arange(8, dtype=torch.uint8, device=device)


# NOTE [Packing writes over no op's output]
# The packed byte is the top byte of x * M (NOTE [Bit packing with one multiply]); it is read out
# as byte 7 of each little-endian int64 (a view) and copied, not shifted and masked in place.
# Under selective checkpointing a policy may save any op's output (``aten.mul``, a shift), and
# SAC's cache holds that very tensor: an in-place write over it raised "Tensor cached during
# selective activation checkpoint has been mutated" in every converted DropPath under a policy
# saving ``mul`` (tests/conformance/test_compositions_28.py), where timm's DropPath runs. The
# product is the only temporary, as before; ``pack_nonzero`` multiplies in place only into the
# buffer it allocated, and nothing writes over the product after that.
_TOP = 7 if sys.byteorder == "little" else 0


def _top_bytes(prod: torch.Tensor) -> torch.Tensor:
    return prod.view(torch.uint8)[_TOP::8].clone(memory_format=torch.contiguous_format)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Pack a boolean (or 0/1) tensor into a 1-D uint8 tensor, 8 elements per byte (LSB first).

    Args:
        mask: boolean tensor of any shape and strides (other dtypes: nonzero is 1).

    Returns:
        1-D uint8 tensor of ``ceil(mask.numel() / 8)`` bytes.
    """
    flat = mask.reshape(-1)
    flat = flat.view(torch.uint8) if flat.dtype == torch.bool else (flat != 0).view(torch.uint8)
    if torch.compiler.is_compiling():  # traceable form (no storage offset, no int64 view)
        pad = (-flat.numel()) % 8
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        w = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=flat.device)
        return (flat.view(-1, 8) * w).sum(dim=1, dtype=torch.uint8)
    if flat.storage_offset() % 8:
        flat = flat.clone()
    n = flat.numel()
    n8 = n - n % 8
    # the only temporary is one int64 per 8 elements (NOTE [Packing writes over no op's output])
    packed = _top_bytes(flat[:n8].view(torch.int64) * PACK_MUL)
    if n8 < n:
        tail = torch.cat([flat[n8:], flat.new_zeros(8 - (n - n8))]).view(torch.int64)
        packed = torch.cat([packed, _top_bytes(tail * PACK_MUL)])
    return packed


def pack_nonzero(t: torch.Tensor) -> torch.Tensor:
    """``pack_bits(t != 0)`` with one temporary: the bool mask, ``t.numel()`` rounded up to 8
    bytes, packed in place (NOTE [Bit packing with one multiply]) and then read out as the
    ``ceil(numel / 8)`` packed bytes. ``pack_bits(t != 0)`` holds the bool mask and an int64 per
    8 elements (2 B per element, as many as eager's float16 dropout output) and a few padded
    copies for a tail of fewer than 8 elements.

    Args:
        t: a tensor of any shape, strides and dtype; its elements are taken in logical (row-major)
            order.

    Returns:
        1-D uint8 tensor of ``ceil(t.numel() / 8)`` bytes, the layout of :func:`pack_bits`.
    """
    n = t.numel()
    m = torch.empty(-(-n // 8) * 8, dtype=torch.bool, device=t.device)
    if m.shape[0] > n:
        m[n:].zero_()  # padding bits are 0
    torch.ne(t, 0, out=m[:n].view(t.shape))
    return _top_bytes(m.view(torch.uint8).view(torch.int64).mul_(PACK_MUL))


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: a 1-D bool tensor of ``numel`` elements (one temporary byte
    per element)."""
    spread = _table(_SPREAD, packed, _build_spread).index_select(0, packed.to(torch.int32))
    return spread.view(torch.uint8)[:numel].view(torch.bool)


def unpack_mask(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """:func:`unpack_bits` with one temporary, the mask itself (``numel`` rounded up to 8 bytes):
    each packed byte shifted right by 0..7 into its 8 mask bytes, then ``& 1`` in place, where
    :func:`unpack_bits` also holds an int32 copy of the packed bytes (4 B per 8 elements) and
    selects 8-byte table rows (the mask's bytes as int64)."""
    sh = _table(_SHIFTS, packed, _build_shifts)
    m = torch.bitwise_right_shift(packed.unsqueeze(1), sh).bitwise_and_(1)
    return m.view(-1)[:numel].view(torch.bool)


def unpack_bits_as(packed: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Like :func:`unpack_bits` but returns 0/1 in ``dtype`` (e.g. float32 for arithmetic
    blending)."""
    return unpack_bits(packed, numel).to(dtype)
