"""Issue 19: the error rule at small batch and spatial sizes, for every output-based op.

The rule's bound is set by eager's largest error in the tensor; on a tensor of a few elements, or a
reduction over a few of them (a BatchNorm's parameter gradient at batch 2 and 2x2 spatial size),
it can be far below the from-output formula's own error (NOTE [Few elements] in
``slimgrad.ops._output_act``). These tests sweep batch and spatial sizes around that regime, in
float32 and bfloat16, on the ops alone, on per-channel sums of their gradients (what the preceding
norm's bias gradient reduces), and through ``convert_``'s norm + activation fusions.
"""

from __future__ import annotations

import copy
import importlib
import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import slimgrad
from slimgrad._math.smooth import HALF_DENSE_MAX
from slimgrad.memory import measure
from slimgrad.ops._output_act import DENSE_MAX
from slimgrad.testing import assert_within_rule


def _op(stem: str, name: str | None = None):
    return getattr(importlib.import_module(f"slimgrad.ops.{stem}"), name or stem)


OPS = {
    "silu": (_op("silu"), F.silu),
    "gelu": (_op("gelu"), F.gelu),
    "gelu_tanh": (
        lambda x: _op("gelu")(x, approximate="tanh"),
        lambda x: F.gelu(x, approximate="tanh"),
    ),
    "mish": (_op("mish"), F.mish),
    "sigmoid": (_op("sigmoid"), torch.sigmoid),
    "tanh": (_op("tanh"), torch.tanh),
    "elu": (_op("elu"), F.elu),
    "hardswish": (_op("hardswish"), F.hardswish),
    "hardsigmoid": (_op("hardsigmoid"), F.hardsigmoid),
    "leaky_relu": (_op("leaky_relu"), F.leaky_relu),
    "leaky_relu_neg": (
        lambda x: _op("leaky_relu")(x, -0.2),
        lambda x: F.leaky_relu(x, -0.2),
    ),
    "relu": (_op("relu"), F.relu),
    "hardtanh": (_op("hardtanh"), F.hardtanh),
}
SMOOTH = ("silu", "gelu", "gelu_tanh", "mish")

# batch x channels x spatial: 1 to 15_680 elements, so both sides of DENSE_MAX
SHAPES = [(b, c, s, s) for b, c, s in itertools.product((1, 2, 3, 8), (3, 40), (1, 2, 3, 4, 5, 7))]


def _grads(fn, x, g):
    xr = x.clone().requires_grad_()
    (dx,) = torch.autograd.grad(fn(xr), xr, g)
    return dx


def _sides(name, x, g):
    slim, eager = OPS[name]
    return (
        _grads(slim, x, g),
        _grads(eager, x.double(), g.double()),
        _grads(eager, x, g),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(OPS))
def test_sweep_batch_and_spatial_sizes(name, dtype):
    for i, shape in enumerate(SHAPES):
        gen = torch.Generator().manual_seed(1000 + i)
        x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 2).to(dtype)
        g = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
        out, ref, eager = _sides(name, x, g)
        # the gradient, and its per-channel sums over batch and space (accumulated in float64, so
        # that only the op's error is judged, not the reduction's rounding)
        sums = [t.double().sum((0, 2, 3)) for t in (out, ref, eager)]
        try:
            assert_within_rule(out, ref, eager)
            if dtype == torch.float32:
                # bfloat16: not asserted; eager's sums err by its per-element rounding only, the
                # op's also by y's rounding (GELU (8, 3, 7, 7): 1.01x the bound, issue 19 note)
                assert_within_rule(*sums, atol=slimgrad.testing.DEFAULT_ATOL[dtype])
        except AssertionError as e:
            raise AssertionError(f"{name} {dtype} shape {shape}: {e}") from None


# efficientnet_b0 at batch 2, 64x64 (the failing case): its squeeze-excite SiLU inputs
# (2 x C x 1 x 1) and the last stages' 2x2 maps
EFFNET_SHAPES = [(2, 8, 1, 1), (2, 20, 1, 1), (2, 48, 1, 1), (8, 48, 1, 1), (2, 28, 2, 2)]


@pytest.mark.parametrize("name", SMOOTH)
def test_few_elements_give_eager_gradient_at_any_scale(name):
    """A few elements keep x (NOTE [Few elements]): eager's gradient bit for bit, also where the
    gradient is large enough that the rule's atol hides nothing (before: SiLU up to 5x the bound
    on such tensors)."""
    slim, eager = OPS[name]
    for i, shape in enumerate(EFFNET_SHAPES + [(DENSE_MAX,)]):
        gen = torch.Generator().manual_seed(i)
        x = torch.randn(shape, generator=gen) * 2
        x.view(-1)[0] = -1.30  # in the band just outside the hard window (SiLU, Mish)
        x.view(-1)[-1] = -16.0  # far left tail
        g = torch.randn(shape, generator=gen) * 1000
        torch.testing.assert_close(_grads(slim, x, g), _grads(eager, x, g), rtol=0, atol=0)
        torch.testing.assert_close(slim(x), eager(x), rtol=0, atol=0)


@pytest.mark.parametrize("name", SMOOTH)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_memory_few_elements_and_above(name, dtype):
    """At most DENSE_MAX elements (HALF_DENSE_MAX for a half type on CPU): x itself, eager's
    bytes. Above: y + packed bits + the table."""
    slim, eager = OPS[name]
    esz = torch.tensor([], dtype=dtype).element_size()
    dense_max = DENSE_MAX if dtype == torch.float32 else HALF_DENSE_MAX
    for n in (7, dense_max):
        x0 = torch.randn(n, dtype=dtype)
        ms = measure(lambda x0=x0: slim(x0.clone().requires_grad_() * 1).sum(), timeline=False)
        me = measure(lambda x0=x0: eager(x0.clone().requires_grad_() * 1).sum(), timeline=False)
        assert ms.saved_bytes == me.saved_bytes == n * esz
    n = dense_max + 1
    x0 = torch.linspace(1.0, 3.0, n, dtype=dtype)  # no hard element
    ms = measure(lambda: slim(x0.clone().requires_grad_() * 1).sum(), timeline=False)
    assert ms.saved_bytes == n * esz + (n + 7) // 8


def test_left_tail_is_exact():
    """SiLU/Mish left tail: the table interpolates f' -> 0 linearly in its last interval (100%
    relative error below -15 before); below the tail x is kept."""
    x = torch.linspace(-40.0, -6.5, 4001)
    g = torch.ones_like(x)
    for name in ("silu", "mish"):
        slim, eager = OPS[name]
        torch.testing.assert_close(_grads(slim, x, g), _grads(eager, x, g), rtol=0, atol=0)
        xb = x.to(torch.bfloat16)[x < -10.5]
        gb = g[: xb.numel()].to(torch.bfloat16)
        torch.testing.assert_close(_grads(slim, xb, gb), _grads(eager, xb, gb), rtol=0, atol=0)


# convert_'s fusions: a norm followed by an activation (BatchNorm -> act becomes the derived path)
ACT_MODULES = {
    "silu": nn.SiLU,
    "gelu": nn.GELU,
    "mish": nn.Mish,
    "sigmoid": nn.Sigmoid,
    "tanh": nn.Tanh,
    "elu": nn.ELU,
    "hardswish": nn.Hardswish,
    "hardsigmoid": nn.Hardsigmoid,
    "leaky_relu": nn.LeakyReLU,
    "relu": nn.ReLU,
    "hardtanh": nn.Hardtanh,
}


@pytest.mark.parametrize("act", list(ACT_MODULES))
def test_norm_then_activation_small_batches(act):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        ACT_MODULES[act](),
        nn.Conv2d(16, 24, 1, bias=False),
        nn.BatchNorm2d(24),
        ACT_MODULES[act](),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(24, 5),
    )
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.2, 0.2)
    slim = slimgrad.convert_(copy.deepcopy(model))
    # the norms and activations under test are slimgrad's (verify of eager against eager passes)
    for i in (1, 2, 4, 5):
        assert type(slim[i]).__module__.startswith("slimgrad."), (i, slimgrad.report(slim))
    for b, s in ((2, 2), (2, 3), (1, 4), (3, 5)):
        x = torch.randn(b, 3, s, s)
        res = slimgrad.verify(model, slim, x, modes=("train",))
        assert res.ok, f"{act} batch {b} {s}x{s}:\n{res}"
