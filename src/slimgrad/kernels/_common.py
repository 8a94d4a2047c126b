"""Pieces shared by the Triton kernels: reductions, bit packing, a counter-based RNG, launch sizes.

Imported only by ``kernels/<stem>.py`` (never at ``import slimgrad``).

# NOTE [Kernels under the interpreter]
``triton.jit`` decides at decoration time whether a function is compiled or interpreted
(``TRITON_INTERPRET=1``), and triton's own helpers (``tl.sum``, ``tl.zeros``, ``tl.cumsum``,
``tl.rand``) are decorated when triton is first imported. The kernels here therefore use only core
builtins (``tl.reduce`` / ``tl.associative_scan`` with ``add`` / ``maximum`` below, ``tl.full``,
``tl.where``, math builtins) and helpers decorated in this package, so that a test process may
import triton before it sets the flag and still interpret every kernel after reloading
``slimgrad.kernels.*`` (``tests/kernels/_kern_helpers.py``). Row loops are ``while`` loops with a
runtime bound (the interpreter cannot turn a runtime bound into ``range``'s int).

# NOTE [Bit order]
Packed masks follow ``slimgrad._math.bits``: element i of a logically row-major flattening is bit
``i % 8`` (least significant first) of byte ``i // 8``; padding bits are 0. A kernel packs a block
of 8*R elements as an (R, 8) tile: ``byte = sum_j bit_j << j`` along the second axis.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# elements per program of the elementwise kernels (a multiple of 8 and of 32)
BLOCK = 1024


def cdiv(n: int, block: int) -> int:
    # triton.cdiv without its wrapper (a constexpr function: microseconds a call on the host)
    return -(-n // block)


def next_power_of_2(n: int) -> int:
    # triton.next_power_of_2 for n >= 1, in plain Python (same reason)
    return 1 << (n - 1).bit_length()


def grid1(n: int, block: int = BLOCK) -> tuple[int]:
    return (max(1, cdiv(n, block)),)


def row_block(d: int) -> int:
    # one row of d elements per tile, up to 8192 (larger rows loop over tiles)
    return min(8192, max(16, next_power_of_2(max(d, 1))))


def num_warps(block: int) -> int:
    # warps per program for a row tile of `block` elements: about 8-16 fp32 values per thread
    return 4 if block <= 2048 else 8 if block <= 4096 else 16


def seed_tensor(device: torch.device) -> torch.Tensor:
    # Two 31-bit words drawn from the device's global generator (follows torch.manual_seed, no
    # host sync on CUDA): the kernel loads them, so a CUDA graph replay draws a fresh mask only if
    # this tensor is refreshed, as for any RNG state.
    return torch.randint(0, 2**31 - 1, (2,), dtype=torch.int64, device=device)


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


# Combine functions for tl.reduce / tl.associative_scan. triton's own (what tl.sum / tl.max use)
# when present: the interpreter recognises them and runs numpy's sum/cumsum/max instead of calling
# the combine function once per element (100x faster tests); compiled, they are the same code.
add = getattr(tl.standard, "_sum_combine", _add)
maximum = getattr(tl.standard, "_elementwise_max", _maximum)


@triton.jit
def cast_out(y, DT: tl.constexpr):
    # float32 -> the output dtype, rounding to nearest even. bfloat16 by hand: triton's interpreter
    # truncates that conversion (the GPU rounds), which would fail the tests' error rule.
    if DT == tl.bfloat16:
        u = y.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return y.to(DT)


@triton.jit
def expm1(x):
    # e^x - 1 without the cancellation of exp(x) - 1 near 0 (relative error ~1e-7): Taylor to x^8
    # for |x| < 0.5 (truncation < 2e-8 relative), exp(x) - 1 beyond (no large cancellation there)
    p = 1.0 / 40320.0
    p = p * x + 1.0 / 5040.0
    p = p * x + 1.0 / 720.0
    p = p * x + 1.0 / 120.0
    p = p * x + 1.0 / 24.0
    p = p * x + 1.0 / 6.0
    p = p * x + 0.5
    p = p * x * x + x
    return tl.where(tl.abs(x) < 0.5, p, tl.exp(x) - 1.0)


@triton.jit
def tanh(x):
    # tanh with a small relative error near 0 (Cephes tanhf's scheme): an odd polynomial for
    # |x| < 0.625, 1 - 2 / (e^{2|x|} + 1) with the sign beyond; NaN propagates
    z = x * x
    p = -5.70498872745e-3
    p = p * z + 2.06390887954e-2
    p = p * z - 5.37397155531e-2
    p = p * z + 1.33314422036e-1
    p = p * z - 3.33332819422e-1
    small = p * z * x + x
    a = tl.abs(x)
    big = 1.0 - 2.0 / (tl.exp(2.0 * a) + 1.0)
    big = tl.where(x < 0, -big, big)
    return tl.where(a < 0.625, small, big)


@triton.jit
def pack_tile(bit):
    # bit: (R, 8) int32 of 0/1 -> (R,) bytes (as int32), bit j of byte r = bit[r, j]
    shift = tl.arange(0, 8)[None, :]
    return tl.reduce(bit << shift, 1, add)


@triton.jit
def unpack(bytes_ptr, i, m):
    # bit i of a packed mask (int32 0/1) for the flat indices i (masked lanes: 0)
    b = tl.load(bytes_ptr + (i >> 3), mask=m, other=0).to(tl.int32)
    return (b >> (i & 7)) & 1


@triton.jit
def philox_u32(seed0, seed1, c0, c1):
    # Philox-4x32 with 7 rounds (Salmon et al., SC'11: "Random123"), first output word only.
    # c0, c1: the 64-bit counter's halves (uint32 blocks); seed0, seed1: the key (uint32 scalars).
    k0 = seed0
    k1 = seed1
    x0 = c0
    x1 = c1
    x2 = c0 * 0
    x3 = c0 * 0
    for _ in tl.static_range(7):
        hi0 = tl.umulhi(x0, 0xD2511F53)
        lo0 = x0 * 0xD2511F53
        hi1 = tl.umulhi(x2, 0xCD9E8D57)
        lo1 = x2 * 0xCD9E8D57
        x0 = hi1 ^ x1 ^ k0
        x1 = lo1
        x2 = hi0 ^ x3 ^ k1
        x3 = lo0
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return x0


@triton.jit
def uniform01(u):
    # uint32 -> float32 in [0, 1) with 24 random bits (exactly representable)
    return (u >> 8).to(tl.float32) * 5.9604644775390625e-08
