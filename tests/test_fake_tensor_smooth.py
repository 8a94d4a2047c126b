"""Issue 19: the smooth activations (SiLU, GELU erf/tanh, Mish) under FakeTensorMode and
torch.compile: their data-dependent side tables are built inside ``slimgrad::<op>_fwd`` custom ops
whose fake kernels size them with ``slimgrad._math.tables.dynamic_size`` (NOTE [Side tables under
FakeTensorMode and torch.compile]); a few elements keep x with static sizes
(NOTE [Few elements])."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from slimgrad._math.smooth import GELU, MISH, SILU, inverse, round_f32


def _op(stem):
    return getattr(importlib.import_module(f"slimgrad.ops.{stem}"), stem)


_gelu = _op("gelu")
OPS = {
    "silu": _op("silu"),
    "gelu": _gelu,
    "gelu_tanh": lambda x: _gelu(x, approximate="tanh"),
    "mish": _op("mish"),
}
SHAPES = [(40, 50), (3, 5)]  # table path (2000 elements), few elements (15)


@pytest.mark.parametrize("shape", SHAPES, ids=["table", "few"])
@pytest.mark.parametrize("env", [False, True], ids=["no_shape_env", "shape_env"])
@pytest.mark.parametrize("name", list(OPS))
def test_forward_and_backward_under_fake_tensors(name, env, shape):
    with FakeTensorMode(shape_env=ShapeEnv() if env else None):
        x = torch.randn(shape, requires_grad=True)
        y = OPS[name](x)
        y.sum().backward()
        assert y.shape == x.shape and x.grad.shape == x.shape


@pytest.mark.parametrize("shape", SHAPES, ids=["table", "few"])
@pytest.mark.parametrize("name", list(OPS))
def test_compile_without_graph_breaks_same_gradient(name, shape):
    fn = OPS[name]

    def f(x):
        # a non-leaf input: on a leaf that requires grad the eager call keeps x (NOTE [An input
        # the graph holds] in slimgrad/ops/_output_act.py; not while compiling), so both sides
        # take the path under test
        return (fn(x * 1) * 1.5).sum()

    torch._dynamo.reset()
    x0 = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 2
    x0.view(-1)[:3] = torch.tensor([-1.28, -0.75, -20.0])  # hard elements (window, tail)
    x = x0.clone().requires_grad_()
    # fullgraph: a graph break raises (with its reason) instead of splitting the graph
    torch.compile(f, backend="aot_eager", fullgraph=True)(x).backward()
    xe = x0.clone().requires_grad_()
    f(xe).backward()
    torch.testing.assert_close(x.grad, xe.grad, rtol=0, atol=0)


def test_round_f32_is_torch_rounding():
    vals = [inverse(s).y_min for s in (SILU, MISH, *GELU.values())]
    vals += [math.pi, -1 / 3, 1 + 2**-24, 1 + 3 * 2**-25, 1e-40, -0.1]
    for v in vals:
        assert round_f32(v) == torch.tensor(v, dtype=torch.float32).item(), v


@pytest.mark.parametrize("name", ["silu", "gelu_tanh"])
def test_compile_dynamic_shapes(name):
    """Symbolic sizes (dynamic=True): the fake kernel takes no static bound from a symbolic numel;
    one compiled graph serves a table-path and a few-element input, each with eager's path's
    gradient."""
    fn = OPS[name]

    def f(x):
        # a non-leaf input: on a leaf that requires grad the eager call keeps x (NOTE [An input
        # the graph holds] in slimgrad/ops/_output_act.py; not while compiling), so both sides
        # take the path under test
        return (fn(x * 1) * 1.5).sum()

    torch._dynamo.reset()
    comp = torch.compile(f, backend="aot_eager", dynamic=True)
    for rows in (40, 37, 3):
        x0 = torch.randn(rows, 50, generator=torch.Generator().manual_seed(rows)) * 2
        x = x0.clone().requires_grad_()
        comp(x).backward()
        xe = x0.clone().requires_grad_()
        f(xe).backward()
        torch.testing.assert_close(x.grad, xe.grad, rtol=0, atol=0)
