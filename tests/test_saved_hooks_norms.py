"""GroupNorm and InPlaceABN under saved-tensor hooks (issue 33: lean ops keep their contract under
hooks): every full-size tensor they keep for backward is handed to the pack hook, so an offload
through ``saved_tensors_hooks`` sees all of it, and the gradients under hooks are the bits
without them."""

import pytest
import torch

from slimgrad.ops.group_norm import group_norm
from slimgrad.ops.inplace_abn import inplace_abn


def _packed_step(fn, params, hooks: bool):
    # (bytes of the non-Parameter tensors of more than one dimension handed to the pack hook,
    # the gradients); ``hooks=False``: the same step without any hook
    packed = []

    def pack(t):
        if not isinstance(t, torch.nn.Parameter) and t.dim() > 1:
            packed.append(t.numel() * t.element_size())
        return t

    if hooks:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = fn()
    else:
        loss = fn()
    grads = torch.autograd.grad(loss, params)
    return sum(packed), grads


def _gn_case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n, c, hw, groups = 3, 8, (7, 5), 2
    x = torch.randn(n, c, *hw, generator=g, requires_grad=True)
    # |beta| < |gamma| everywhere: no fallback channel keeps its input (ops/group_norm.py)
    w = torch.nn.Parameter(torch.rand(c, generator=g) + 0.5)
    b = torch.nn.Parameter((torch.rand(c, generator=g) - 0.5) * 0.4)
    # the cotangent: the output times a fixed tensor (a square would keep y a second time)
    r = torch.randn(n, c, *hw, generator=g)
    return x, w, b, groups, r


def test_group_norm_hands_what_it_keeps_to_the_hooks():
    x, w, b, groups, r = _gn_case()

    def fn():
        return (group_norm(x, groups, w, b) * r).sum()

    got, grads = _packed_step(fn, (x, w, b), hooks=True)
    # the output y (full size) and mean and rstd ((N, G) float32 each): the Memory line; and r,
    # which the product keeps
    assert got == 2 * x.numel() * 4 + 2 * x.shape[0] * groups * 4
    _, plain = _packed_step(fn, (x, w, b), hooks=False)
    for a, p in zip(grads, plain, strict=True):
        assert torch.equal(a, p)


def test_group_norm_under_save_on_cpu_gives_the_bits_without_hooks():
    x, w, b, groups, r = _gn_case(1)

    def fn():
        return (group_norm(x, groups, w, b) * r).sum()

    with torch.autograd.graph.save_on_cpu():
        loss = fn()
    got = torch.autograd.grad(loss, (x, w, b))
    want = torch.autograd.grad(fn(), (x, w, b))
    for a, p in zip(got, want, strict=True):
        assert torch.equal(a, p)


@pytest.mark.parametrize("activation", ["leaky_relu", "elu", "identity"])
def test_inplace_abn_hands_what_it_keeps_to_the_hooks(activation):
    g = torch.Generator().manual_seed(2)
    n, c, hw = 4, 6, (5, 3)
    x0 = torch.randn(n, c, *hw, generator=g, requires_grad=True)
    w = torch.nn.Parameter(torch.rand(c, generator=g) + 0.5)
    b = torch.nn.Parameter(torch.randn(c, generator=g) * 0.2)
    r = torch.randn(n, c, *hw, generator=g)

    def fn():
        h = x0 * 1.5  # a non-leaf the op may write over
        rm, rv = torch.zeros(c), torch.ones(c)
        z = inplace_abn(h, rm, rv, w, b, True, activation=activation, activation_param=0.3)
        return (z * r).sum()

    got, grads = _packed_step(fn, (x0, w, b), hooks=True)
    _, plain = _packed_step(fn, (x0, w, b), hooks=False)
    # z (the output, in x's storage) is the one full-size tensor it keeps (the side tensors of
    # channels the activation cannot invert have no element: these three invert everywhere), and
    # the product keeps r
    full = n * c * hw[0] * hw[1] * 4
    assert got == 2 * full
    for a, p in zip(grads, plain, strict=True):
        assert torch.equal(a, p)
