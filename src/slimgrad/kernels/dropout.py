"""Triton kernels for dropout with a 1-bit packed mask: draw + apply + pack, then unpack + scale.

Same signatures as ``slimgrad.ops.dropout._fwd_torch`` (``(x, p) -> (out, bits)``),
``_fwd_inplace_torch`` (``(x, p) -> bits``, x overwritten) and ``_bwd_torch`` (``(g, bits, p,
fused, inplace=False) -> dx``); the bits use ``ops.dropout.pack_bits``'s order (NOTE [Bit order]
in ``kernels/_common.py``).

# NOTE [Triton dropout masks]
The forward kernel draws its own mask: element i is kept when ``u_i < 1 - p``, with u_i the first
word of Philox-4x32-7 at counter i (64-bit) under a 64-bit key, mapped to [0, 1) with 24 bits.
The key is two words drawn from the global generator of x's device (``torch.randint``), so the mask
follows ``torch.manual_seed`` and successive calls draw independent masks, but it is NOT the mask
eager ``F.dropout`` / the PyTorch path would draw at the same RNG state. What is exact is the rest:
the forward output is ``x * (m * 1/(1-p))`` as ``native_dropout`` computes it, the packed bits are
those of the mask the forward applied, and the backward applies them exactly as ``_bwd_torch``
does (bit for bit, both ``fused`` conventions). The tests check forward/backward consistency, bit
identity of the backward, and the keep rate's statistics.

Memory: as ``slimgrad.ops.dropout`` (1/8 B/elt saved); no byte mask is materialised, in either
direction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slimgrad._errors import internal_error
from slimgrad._math.bits import packed_numel
from slimgrad._math.dropout import noise_scale_value
from slimgrad.kernels._common import (
    BLOCK,
    cast_out,
    cdiv,
    pack_tile,
    philox_u32,
    seed_tensor,
    uniform01,
    unpack,
)

# the submodule (slimgrad.ops re-exports functions under the same names)


@triton.jit
def _fwd_kernel(
    x_ptr, out_ptr, bits_ptr, seed_ptr, n, keep_prob, scale, BLOCK: tl.constexpr
):  # fmt: skip

    R: tl.constexpr = BLOCK // 8
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * R + tl.arange(0, R)
    i = rows[:, None] * 8 + tl.arange(0, 8)[None, :]
    m = i < n
    s0 = tl.load(seed_ptr).to(tl.uint32)
    s1 = tl.load(seed_ptr + 1).to(tl.uint32)
    u = uniform01(philox_u32(s0, s1, i.to(tl.uint32), (i >> 32).to(tl.uint32)))
    keep = (u < keep_prob) & m
    x = tl.load(x_ptr + i, mask=m, other=0.0).to(tl.float32)
    out = x * (keep.to(tl.float32) * scale)
    tl.store(out_ptr + i, cast_out(out, out_ptr.dtype.element_ty), mask=m)
    byte = pack_tile(keep.to(tl.int32))
    tl.store(bits_ptr + rows, byte.to(tl.uint8), mask=rows * 8 < n)


@triton.jit
def _bwd_kernel(g_ptr, bits_ptr, dx_ptr, n, scale, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    keep = unpack(bits_ptr, i, m)
    g = tl.load(g_ptr + i, mask=m, other=0.0).to(tl.float32)
    # kept: g * scale; dropped: g * 0 (+-0, NaN for a non-finite g), also when scale is inf in
    # the dtype (p near 1), as _bwd_torch
    dx = tl.where(keep == 1, g * scale, g * 0.0)
    tl.store(dx_ptr + i, cast_out(dx, dx_ptr.dtype.element_ty), mask=m)


_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def supports(t: torch.Tensor) -> bool:
    """Whether these kernels take ``t`` (the op runs its PyTorch path otherwise)."""
    return t.dtype in _DTYPES and t.is_contiguous()


def _unsupported(t: torch.Tensor):
    return internal_error(
        f"slimgrad.kernels.dropout: called on a {t.dtype} tensor (contiguous: "
        f"{t.is_contiguous()}) it does not take; the op checks supports() first"
    )


def _draw(x: torch.Tensor, out: torch.Tensor, p: float) -> torch.Tensor:
    n = x.numel()
    bits = torch.empty(packed_numel(n), dtype=torch.uint8, device=x.device)
    seed = seed_tensor(x.device)
    if n:
        grid = (cdiv(n, BLOCK),)
        _fwd_kernel[grid](x, out, bits, seed, n, 1.0 - p, 1.0 / (1.0 - p), BLOCK=BLOCK)
    return bits


def _fwd_triton(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Out-of-place dropout: (out, packed mask). Non-contiguous inputs take the PyTorch path (its
    output keeps x's strides, as the op's fake kernel declares)."""
    if not supports(x):
        raise _unsupported(x)
    out = torch.empty_like(x)
    return out, _draw(x, out, p)


def _fwd_inplace_triton(x: torch.Tensor, p: float) -> torch.Tensor:
    """In-place dropout: x <- x * m / (1 - p); returns the packed mask."""
    if not supports(x):
        raise _unsupported(x)
    bits = _draw(x, x, p)
    torch.autograd.graph.increment_version(x)  # a raw write: autograd must see it
    return bits


def _bwd_triton(
    g: torch.Tensor, bits: torch.Tensor, p: float, fused: bool, inplace: bool = False
) -> torch.Tensor:
    """dx = g * m / (1 - p), rounded as ``_bwd_torch`` rounds it (``fused``: float32 scale, as
    ``native_dropout_backward``; else the scale rounded to g's dtype first, as eager's CPU
    ``g * noise``). ``inplace``: write into g (a caller-owned temporary)."""
    if g.dtype not in _DTYPES or (inplace and not g.is_contiguous()):
        raise _unsupported(g)
    gc = g.contiguous()
    dx = gc if inplace else torch.empty_like(gc)
    scale = 1.0 / (1.0 - p) if fused else noise_scale_value(p, g.dtype, g.device)
    n = g.numel()
    if n:
        _bwd_kernel[(cdiv(n, BLOCK),)](gc, bits, dx, n, float(scale), BLOCK=BLOCK)
    if inplace:
        torch.autograd.graph.increment_version(dx)
    return dx
