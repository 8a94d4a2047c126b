"""Bit-packing of boolean masks: moved to :mod:`slimgrad._math.bits` (below both ops and kernels,
NOTE [Kernels are leaves] in ``slimgrad._math``); re-exported here for the ops that import it."""

from slimgrad._math.bits import (
    PACK_MUL,
    pack_bits,
    pack_nonzero,
    packed_numel,
    unpack_bits,
    unpack_bits_as,
    unpack_mask,
)

__all__ = [
    "PACK_MUL",
    "pack_bits",
    "pack_nonzero",
    "packed_numel",
    "unpack_bits",
    "unpack_bits_as",
    "unpack_mask",
]
