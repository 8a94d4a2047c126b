"""Memory order of an elementwise op's input, and eager's output on a strided input.

Shared by the smooth activations' ops (``slimgrad.ops._output_act``) and their Triton kernels
(``slimgrad.kernels._output_act``): NOTE [Kernels are leaves] in ``slimgrad._math``.

# NOTE [Eager's output on a strided input]
Eager's float32 CPU kernels do not give the same bits for the same value on every layout: GELU
on a contiguous tensor runs oneDNN's kernel, on any other layout ATen's vectorized one (3,606 of
5,120 N(0, 1.5) values differ, by up to 2e-7 where ``1 + erf`` cancels); SiLU and Mish give a
row's scalar tail other bits than a contiguous run's vector body. A smooth activation that
computed y on a contiguous copy of a sliced or transposed input returned other bits than eager:
HF Wav2Vec2's positional conv embedding feeds ``conv(x)[:, :, :-1]`` (SamePad) to its GELU, and
on a tiny Wav2Vec2ForCTC with a CTC sum loss those ulps, carried through two encoder layers,
took 19 gradients outside the error rule (issue 30). So y is computed by eager's own call on x
in x's own layout (:func:`in_memory_order`), the side information (bits, hard elements) on x's
memory-order view, and y comes back in eager's layout: x's strides for a dense x, contiguous for
one with gaps (as ``torch.empty_like``, which the ops' fake kernels return). Same bits as eager
on every layout (tests/ops/test_smooth_strided_input.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def memory_order(x: torch.Tensor) -> tuple[int, ...] | None:
    """The permutation ``p`` with ``out.permute(p)`` contiguous for eager's output layout ``out`` of
    an elementwise op on ``x`` (``torch.empty_like``: x's strides when x is dense, else its
    dimension order); None for the identity (NOTE [Layout of the smooth activations] in
    ``slimgrad.ops._output_act``)."""
    if x.is_contiguous() or x.dim() < 2:
        return None
    like = torch.empty_like(x, device="meta")
    st = like.stride()
    p = tuple(sorted(range(x.dim()), key=lambda d: (-st[d], d)))
    if p == tuple(range(x.dim())) or not like.permute(p).is_contiguous():
        return None
    return p


def inverse_perm(p: tuple[int, ...]) -> tuple[int, ...]:
    inv = [0] * len(p)
    for i, d in enumerate(p):
        inv[d] = i
    return tuple(inv)


def eager_output(x: torch.Tensor, fwd: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``fwd(x)`` on x's own layout (eager's bits), in ``torch.empty_like(x)``'s layout (NOTE
    [Eager's output on a strided input])."""
    y = fwd(x)
    if x.is_contiguous():  # so is y: no meta tensor to dispatch (the few-element path's op count)
        return y
    want = torch.empty_like(x, device="meta").stride()
    if y.stride() != want:  # a layout with gaps whose order is not x's dimension order
        y = torch.empty_like(x).copy_(y)
    return y


def in_memory_order(x: torch.Tensor, fwd: Callable, run: Callable) -> tuple:
    """``run(xm, fwd_m) -> (y_m, *side)`` on x's memory-order view ``xm`` (contiguous for a dense
    x; x itself otherwise), with y computed once as ``fwd(x)`` in x's own layout and handed to
    ``run`` through ``fwd_m``; returns ``(y, *side)`` with y in ``torch.empty_like(x)``'s layout
    (NOTE [Eager's output on a strided input]). A contiguous x runs ``run(x, fwd)`` as it is."""
    if x.is_contiguous():
        return run(x, fwd)
    y = eager_output(x, fwd)
    p = memory_order(x)
    xm, ym = (x, y) if p is None else (x.permute(p), y.permute(p))
    out = run(xm, lambda t: ym.reshape(t.shape))
    return (y, *out[1:])
