"""Converted ops under FakeTensorMode, as an independent tracker runs them (issue 19).

Each op's forward and backward run on fake tensors under two trackers: a plain ``FakeTensorMode()``
(no ShapeEnv: data-dependent side tables get their usual length, 0) and one with a ``ShapeEnv``
(tables get an unbacked size). NOTE [Side tables under FakeTensorMode and torch.compile] in
``slimgrad/_math/tables.py``. The table ops on real tensors are eager's ``nonzero`` and
``masked_select``, bit for bit (each op's own tests check its eager results).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from slimgrad._math.tables import dynamic_size, index_table, select_table, unsized


def _mod(name):
    return importlib.import_module(f"slimgrad.ops.{name}")


def _ln(x, w, b):
    d = x.shape[-1]
    return _mod("layer_norm").layer_norm(x, (d,), w[:d], b[:d])


def _rms(x, w, b):
    return _mod("rms_norm").rms_norm(x, (x.shape[-1],), w[: x.shape[-1]])


def _hf_rms(x, w, b):
    return _mod("rms_norm").hf_rms_norm(x, w[: x.shape[-1]], 1e-6)


def _gn(x4, w, b):
    return _mod("group_norm").group_norm(x4, 2, w[:4], b[:4])


def _bn(x4, w, b):
    c = x4.shape[1]
    rm, rv = torch.zeros(c), torch.ones(c)
    y = _mod("batch_norm").batch_norm(x4, rm, rv, w[:c], b[:c], training=True)
    return _mod("_derived").activation(y, "relu")


def _conv(x4, w, b):
    return _mod("conv").conv2d(x4, w[:36].reshape(4, 1, 3, 3), b[:4], padding=1, groups=4)


def _linear(x, w, b):
    return _mod("linear").linear(x, w[:24].reshape(3, 8), b[:3])


def _matmul(x, w, b):
    return _mod("matmul").matmul(x, b[:40].reshape(8, 5))


def _gated(x, w, b):
    wg = w[:48].reshape(6, 8)
    return _mod("gated_mlp").gated_mlp(x, wg, wg * 2, w[:48].reshape(8, 6))


def _sdm(x, w, b):
    s = x.reshape(2, 4, 5, 8)[..., :5]
    return _mod("softmax_dropout").softmax_dropout_matmul(s, x.reshape(2, 4, 5, 8), 0.2)


ROWS = {  # name: (fn(x, w, b), input shape)
    "layer_norm": (_ln, (40, 8)),
    "rms_norm": (_rms, (40, 8)),
    "hf_rms_norm": (_hf_rms, (40, 8)),
    "group_norm": (_gn, (2, 4, 5, 8)),
    "batch_norm+relu": (_bn, (2, 4, 5, 8)),
    "conv2d": (_conv, (2, 4, 5, 8)),
    "linear": (_linear, (40, 8)),
    "matmul": (_matmul, (40, 8)),
    "gated_mlp": (_gated, (40, 8)),
    "softmax_dropout_matmul": (_sdm, (40, 8)),
    "elu": (lambda x, w, b: _mod("elu").elu(x * 3), (40, 8)),
    "elu_neg_alpha": (lambda x, w, b: _mod("elu").elu(x * 3, -0.5), (40, 8)),
    "hardswish": (lambda x, w, b: _mod("hardswish").hardswish(x * 3), (40, 8)),
    "hardsigmoid": (lambda x, w, b: _mod("hardsigmoid").hardsigmoid(x * 3), (40, 8)),
    "dropout": (lambda x, w, b: _mod("dropout").dropout(x, 0.3), (40, 8)),
}


UNWEIGHTED = {"softmax_dropout_matmul", "elu", "elu_neg_alpha", "hardswish", "hardsigmoid"}
UNWEIGHTED |= {"dropout", "matmul"}


@pytest.mark.parametrize("shape_env", [False, True], ids=["plain", "shape_env"])
@pytest.mark.parametrize("name", list(ROWS))
def test_forward_and_backward_under_fake_tensors(name, shape_env):
    fn, shape = ROWS[name]
    with FakeTensorMode(shape_env=ShapeEnv() if shape_env else None):
        x = torch.randn(shape, requires_grad=True)
        w = torch.randn(64, requires_grad=True)
        b = torch.randn(64, requires_grad=True)
        y = fn(x, w, b)
        y.sum().backward()
        assert x.grad is not None and x.grad.shape == x.shape
        assert (w.grad is not None) == (name not in UNWEIGHTED)


def test_layer_norm_fake_fallback_table_has_a_symbolic_length_with_a_shape_env():
    ln = _mod("layer_norm")
    with FakeTensorMode(shape_env=ShapeEnv()):
        x, w, b = torch.randn(6, 8), torch.randn(8), torch.randn(8)
        _, _, _, idx, xside = ln._layer_norm_fwd(x, [8], w, b, 1e-5)
        assert isinstance(idx.shape[0], torch.SymInt)
        assert str(xside.shape[1]) == str(idx.shape[0])
    with FakeTensorMode():
        x, w, b = torch.randn(6, 8), torch.randn(8), torch.randn(8)
        _, _, _, idx, xside = ln._layer_norm_fwd(x, [8], w, b, 1e-5)
        assert idx.shape == (0,) and xside.shape == (6, 0)


def test_dynamic_size_without_a_shape_env_is_the_usual_length():
    @torch.library.custom_op("slimgrad_test::table_len", mutates_args=())
    def op(x: torch.Tensor) -> torch.Tensor:
        return x.nonzero().view(-1)

    seen = []

    @op.register_fake
    def _(x):
        seen.append((dynamic_size(max=x.numel(), otherwise=3), dynamic_size(max=2, otherwise=3)))
        return x.new_empty(seen[-1][0], dtype=torch.int64)

    with FakeTensorMode():
        assert op(torch.randn(5)).shape == (3,)
    assert seen[-1] == (3, 2)
    with FakeTensorMode(shape_env=ShapeEnv()):
        out = op(torch.randn(5))
    assert isinstance(out.shape[0], torch.SymInt)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_table_ops_are_nonzero_and_masked_select(dtype):
    x = torch.randn(7, 5)
    x[2, 3] = float("nan")
    mask = x < -0.3
    want = mask.reshape(-1).nonzero().view(-1).to(dtype)
    assert torch.equal(index_table(mask, dtype), want)
    idx, vals = select_table(x, mask, dtype)
    assert torch.equal(idx, want) and torch.equal(vals, torch.masked_select(x, mask))
    assert not unsized(x)
    with FakeTensorMode():
        assert unsized(torch.randn(3))
        assert index_table(torch.randn(3) > 0, dtype).shape == (0,)
