"""Dropout that keeps its mask as 1 bit per element.

Math (as ``torch.nn.functional.dropout``): ``y = x * m / (1 - p)`` with ``m ~ Bernoulli(1 - p)``
drawn per element; ``dx = dy * m / (1 - p)``. ``p == 0`` or ``training=False`` returns ``x`` itself;
``p == 1`` returns ``x * 0`` (NaN where x is inf/NaN, as eager).

Memory: saves the mask bit-packed, 1/8 B/elt (uint8, ``ceil(n / 8)`` bytes); eager saves a float
mask of the input's dtype on CPU (4 B/elt fp32) and a bool mask (1 B/elt) on CUDA.
Backward writes dx into the incoming gradient's buffer when ``slimgrad.ownership.take`` proves it
dead (NOTE [Gradient-buffer ownership]); otherwise, and under torch.compile, out of place.

# NOTE [Dropout masks: drawn like eager, kept as bits]
The mask is drawn exactly as eager PyTorch draws it, from the global generator of the input's
device, so it follows ``torch.manual_seed`` and is *the same mask eager would draw* at the same RNG
state: on CUDA out-of-place, the forward calls ``torch.native_dropout`` (what ``F.dropout`` uses
there); on CPU, and in-place everywhere, it runs eager's own ``noise = empty_like(x).bernoulli_(1 -
p).div_(1 - p); x * noise``. The mask is then packed into bits and the backward unpacks those bits,
so the backward mask is the forward mask by construction (no RNG replay, which is what broke
memsave_torch's dropout for p != 0.5), on any device, under autocast and torch.compile (the RNG draw
happens inside an opaque custom op), and successive calls draw independent masks because the
generator advances. The backward multiplies as eager's backward does (CPU and in-place: ``dy *
noise`` with ``noise = m / (1 - p)`` rounded to the dtype; CUDA out-of-place:
``native_dropout_backward``), so gradients match eager bit for bit."""

from __future__ import annotations

import torch

from slimgrad import ownership
from slimgrad.kernels import _backend
from slimgrad.ops._library import custom_op

__all__ = ["dropout", "dropout_"]

# NOTE [Bit packing with one multiply]
# Eight 0/1 bytes read as one little-endian int64 x = sum_i b_i 2^(8i). Multiplying by
# M = 0x0102040810204080 (byte j of M is 2^(7-j)) puts b_i at bit 56 + i with no carries (every
# product bit lands on a distinct position below bit 64 or is dropped by the 64-bit wrap), so
# (x * M) >> 56 & 0xFF = sum_i b_i 2^i: one int64 multiply per 8 elements instead of shifts and a
# reduction. Unpacking looks up each byte in a 256-entry table of int64 "spread" bytes. Tested for
# every byte value and for lengths that are not multiples of 8 (tests/ops/test_dropout.py).
_PACK_MUL = 0x0102040810204080
_SPREAD_CACHE: dict[torch.device, torch.Tensor] = {}


def _cacheable(t: torch.Tensor) -> bool:
    # Never cache (nor reuse a cached table for) fake tensors: slimgrad.memory.estimate runs these
    # implementations under FakeTensorMode.
    return type(t) is torch.Tensor


def _spread_table(device: torch.device, like: torch.Tensor) -> torch.Tensor:
    t = _SPREAD_CACHE.get(device) if _cacheable(like) else None
    if t is None:
        v = torch.arange(256, dtype=torch.int64, device=device)
        bits = (v.unsqueeze(1) >> torch.arange(8, device=device)) & 1  # bit i of v in byte i
        t = bits.to(torch.uint8).view(torch.int64).reshape(256)
        if _cacheable(t):
            _SPREAD_CACHE[device] = t
    return t


def _packed_numel(n: int) -> int:
    return (n + 7) // 8


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Pack a bool tensor (any shape) into ``ceil(numel / 8)`` uint8, bit i of byte k = elt 8k+i."""
    flat = mask.reshape(-1)
    flat = flat.view(torch.uint8) if flat.dtype == torch.bool else (flat != 0).view(torch.uint8)
    if flat.storage_offset() % 8:
        flat = flat.clone()
    n = flat.numel()
    n8 = n - n % 8
    # the only temporary is one int64 per 8 elements (shifted and masked in place)
    packed = (flat[:n8].view(torch.int64) * _PACK_MUL).bitwise_right_shift_(56).bitwise_and_(0xFF)
    packed = packed.to(torch.uint8)
    if n8 < n:
        tail = torch.cat([flat[n8:], flat.new_zeros(8 - (n - n8))]).view(torch.int64)
        tail = ((tail * _PACK_MUL) >> 56).bitwise_and_(0xFF).to(torch.uint8)
        packed = torch.cat([packed, tail])
    return packed


def unpack_bits(bits: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: a bool tensor of ``shape`` (one temporary byte per element)."""
    n = 1
    for s in shape:
        n *= s
    spread = _spread_table(bits.device, bits).index_select(0, bits.to(torch.int32))
    return spread.view(torch.uint8)[:n].view(torch.bool).view(shape)


def _noise_scale(p: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # 1 / (1 - p) rounded to dtype exactly as eager's ``noise.div_(1 - p)`` rounds it.
    return torch.ones((), dtype=dtype, device=device).div_(1 - p)


def _fused(x: torch.Tensor) -> bool:
    return x.device.type != "cpu"


def _fwd_torch(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    if _fused(x):  # eager's CUDA path
        out, mask = torch.native_dropout(x, p, True)
        return out, pack_bits(mask)
    # eager's CPU path, op for op (native_dropout's x * m * scale differs in the last bit for
    # some p, e.g. 1e-6)
    noise = torch.empty_like(x).bernoulli_(1 - p)
    bits = pack_bits(noise != 0)
    # noise * x == x * noise bit for bit; writing it into noise spares eager's extra buffer
    return noise.div_(1 - p).mul_(x), bits


def _fwd_inplace_torch(x: torch.Tensor, p: float) -> torch.Tensor:
    noise = torch.empty_like(x).bernoulli_(1 - p)
    bits = pack_bits(noise != 0)
    noise.div_(1 - p)
    x.mul_(noise)
    return bits


def _apply_mask_torch(
    g: torch.Tensor, bits: torch.Tensor, p: float, fused: bool, inplace: bool = False
) -> torch.Tensor:
    # dy * m / (1 - p), rounded exactly as eager's backward; also rebuilds the forward output from
    # its input. CPU and in-place: (g * m) * s equals eager's g * noise bit for bit (noise = m * s
    # in dtype; g * 1 = g exactly, g * 0 = +-0 or NaN as in eager); the mask is the only
    # temporary (1 B/elt). inplace=True overwrites g (a caller-owned temporary).
    mask = unpack_bits(bits, g.shape)
    if fused:
        if inplace:  # the same kernel, its result written into g
            return torch.ops.aten.native_dropout_backward.out(g, mask, 1.0 / (1 - p), out=g)
        return torch.ops.aten.native_dropout_backward(g, mask, 1.0 / (1 - p))
    scale = _noise_scale(p, g.dtype, g.device)
    if 1.0 / (1 - p) >= torch.finfo(g.dtype).max:  # scale is inf in dtype: 0 * inf would be NaN
        noise = torch.where(mask, scale, torch.zeros((), dtype=g.dtype, device=g.device))
        return g.mul_(noise) if inplace else g * noise
    out = g.mul_(mask) if inplace else g.mul(mask)
    return out.mul_(scale)


_bwd_torch = _apply_mask_torch


@custom_op("dropout_fwd", mutates_args=())
def _dropout_fwd(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    if _backend.use_triton(x, auto=False):
        return _backend.kernels("dropout")._fwd_triton(x, p)
    return _fwd_torch(x, p)


@_dropout_fwd.register_fake
def _(x, p):
    return torch.empty_like(x), x.new_empty((_packed_numel(x.numel()),), dtype=torch.uint8)


@custom_op("dropout_fwd_", mutates_args=("x",))
def _dropout_fwd_(x: torch.Tensor, p: float) -> torch.Tensor:
    if _backend.use_triton(x, auto=False):
        return _backend.kernels("dropout")._fwd_inplace_triton(x, p)
    return _fwd_inplace_torch(x, p)


@_dropout_fwd_.register_fake
def _(x, p):
    return x.new_empty((_packed_numel(x.numel()),), dtype=torch.uint8)


@custom_op("dropout_apply_mask", mutates_args=())
def _dropout_apply_mask(g: torch.Tensor, bits: torch.Tensor, p: float, fused: bool) -> torch.Tensor:
    if _backend.use_triton(g, auto=False):
        return _backend.kernels("dropout")._bwd_triton(g.contiguous(), bits, p, fused)
    return _apply_mask_torch(g.contiguous(), bits, p, fused)


@_dropout_apply_mask.register_fake
def _(g, bits, p, fused):
    return torch.empty_like(g, memory_format=torch.contiguous_format)


def _backward(grad, bits, p, fused, owned):
    # owned: grad's buffer is dead (slimgrad.ownership.take granted it; never under torch.compile,
    # where take refuses): dx is written into it, eagerly, outside the custom op.
    if owned:
        if _backend.use_triton(grad, auto=False):
            k = _backend.kernels("dropout")
            return k._bwd_triton(grad, bits, p, fused, inplace=True)
        return _apply_mask_torch(grad, bits, p, fused, inplace=True)
    # With create_graph the plain-PyTorch path runs so that double backward works.
    if torch.is_grad_enabled():
        return _apply_mask_torch(grad, bits, p, fused)
    return _dropout_apply_mask(grad, bits, p, fused)


class _DropoutFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float):
        out, bits = _dropout_fwd(x, p)
        ctx.p, ctx.fused = p, _fused(x)
        ctx.save_for_backward(bits)
        ctx.mark_non_differentiable(bits)
        return out, bits

    @staticmethod
    def backward(ctx, grad, _grad_bits):
        owned = ownership.take(grad) is not None  # first use: NOTE [Gradient-buffer ownership]
        (bits,) = ctx.saved_tensors
        return _backward(grad, bits, ctx.p, ctx.fused, owned), None


class _DropoutInplaceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float):
        bits = _dropout_fwd_(x, p)
        ctx.p = p
        ctx.mark_dirty(x)
        ctx.save_for_backward(bits)
        ctx.mark_non_differentiable(bits)
        return x, bits

    @staticmethod
    def backward(ctx, grad, _grad_bits):
        owned = ownership.take(grad) is not None  # first use: NOTE [Gradient-buffer ownership]
        (bits,) = ctx.saved_tensors
        return _backward(grad, bits, ctx.p, False, owned), None


def _check_p(api: str, p: float) -> None:
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise TypeError(
            f"slimgrad.{api}: p must be a float; expected a number in [0, 1], got "
            f"{type(p).__name__}. Pass e.g. p=0.1."
        )
    if not 0.0 <= p <= 1.0:
        raise ValueError(
            f"slimgrad.{api}: dropout probability out of range; expected 0 <= p <= 1, "
            f"got {p}. Pass a probability such as p=0.1."
        )


def _dropout_with_bits(
    input: torch.Tensor, p: float, inplace: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    # Training-mode dropout for 0 < p < 1 on a non-empty tensor; also returns the packed mask.
    if inplace:
        return _DropoutInplaceFn.apply(input, float(p))
    return _DropoutFn.apply(input, float(p))


def dropout(
    input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
) -> torch.Tensor:
    """Dropout with a 1-bit mask kept for backward; same values and gradients as ``F.dropout``.

    ``y = x * m / (1 - p)``, ``m ~ Bernoulli(1 - p)`` from the device's global generator (see
    NOTE [Dropout masks: drawn like eager, kept as bits]).

    Memory: saves 1/8 B/elt (the packed mask); eager saves 4 B/elt (fp32, CPU) or 1 B/elt (CUDA).

    Args:
        input: any tensor.
        p: probability of an element being zeroed, in [0, 1].
        training: apply dropout if True; otherwise return ``input``.
        inplace: write the result into ``input``.

    Returns:
        The dropped tensor (``input`` itself when ``p == 0``, ``training`` is False or it is empty).

    Raises:
        ValueError: ``p`` outside [0, 1].
        TypeError: ``p`` not a number.

    Example:
        >>> y = dropout(torch.randn(4, 8, requires_grad=True), p=0.1)
    """
    _check_p("ops.dropout", p)
    if p == 0 or not training or input.numel() == 0:
        return input
    if p == 1:
        zero = input.new_zeros(())
        return input.mul_(zero) if inplace else input * zero
    return _dropout_with_bits(input, p, inplace)[0]


def dropout_(input: torch.Tensor, p: float = 0.5, training: bool = True) -> torch.Tensor:
    """In-place :func:`dropout` (``F.dropout(..., inplace=True)``). Memory: 1/8 B/elt."""
    return dropout(input, p, training, inplace=True)
