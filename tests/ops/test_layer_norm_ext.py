"""LayerNorm's backward issued from C++ (NOTE [LayerNorm's backward from C++] in
ops/layer_norm.py; ``_ext/backward.cpp`` ``layer_norm_bwd``): the Python body's bits, taken on
every converted LayerNorm's granted backward, and None (the Python body) wherever it does not
apply."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from slimgrad import _ext
from slimgrad.kernels import _backend

L = importlib.import_module("slimgrad.ops.layer_norm")


@pytest.fixture
def ext():
    if not _ext.available():
        pytest.skip(f"slimgrad's C++ extension is not available here: {_ext.error()}")
    return _ext.load()


def _case(shape, ns, affine, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    w = torch.randn(ns, generator=g) if affine in ("wb", "w") else None
    b = torch.randn(ns, generator=g) if affine == "wb" else None
    y, _, rstd = torch.native_layer_norm(x, list(ns), w, b, 1e-5)
    dy = torch.randn(shape, generator=g)
    return y, rstd, w, b, dy


def _lib(y):
    lib = _backend.use_cpu(y, L.C_STEM)
    if lib is None:
        pytest.skip("the LayerNorm C kernel is not built here")
    return lib


_ALL, _NO_DW, _NO_DB = (True, True, True), (True, False, True), (True, True, False)


@pytest.mark.parametrize(
    "shape,ns,affine,mask",
    [
        ((1, 16, 64), (64,), "wb", _ALL),
        ((3, 37, 24), (24,), "wb", _ALL),
        ((3, 37, 24), (24,), "wb", _NO_DW),
        ((3, 37, 24), (24,), "w", _NO_DB),
        ((3, 37, 24), (24,), "none", _ALL),
        ((2, 41, 4, 6), (4, 6), "wb", _ALL),
        ((5, 1), (1,), "wb", _ALL),
    ],
)
def test_bits_as_the_python_body(ext, shape, ns, affine, mask):
    # one row block and several (the float64 parts and scratch: 111 and 82 rows), a 2-D
    # normalized shape (dgamma and dbeta in the weight's shape), no bias, no affine, frozen
    # weight or bias: dx (written over dy), dgamma and dbeta equal _bwd_cpu's bit for bit
    y, rstd, w, b, dy = _case(shape, ns, affine)
    lib = _lib(y)
    buf_py, buf_c = dy.clone(), dy.clone()
    ref = L._bwd_cpu(buf_py, y, None, rstd, None, None, w, b, list(ns), list(mask), buf_py, lib)
    got = ext.layer_norm_bwd(
        buf_c, y, rstd, w, b, list(ns), *mask, L._ln_bwd_addr(lib), L.C_MIN_BLOCK_ROWS,
        L.C_MAX_BLOCKS,
    )  # fmt: skip
    assert got is not None
    assert got[0] is buf_c or got[0].data_ptr() == buf_c.data_ptr()  # dx over the granted dy
    for r, g in zip(ref, got, strict=True):
        assert (r is None) == (g is None)
        if r is not None:
            assert r.shape == g.shape and r.dtype == g.dtype
            assert torch.equal(r, g)


class _Mode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_none_where_the_case_does_not_hold(ext):
    # a dispatch mode (slimgrad.memory's tracker sees the Python body), a float64 or
    # non-contiguous operand, a subclass: None, and dy untouched
    y, rstd, w, b, dy = _case((2, 40, 8), (8,), "wb")
    lib = _lib(y)
    a = L._ln_bwd_addr(lib)

    def call(dy_, y_=y, w_=w):
        before = dy_.clone()
        r = ext.layer_norm_bwd(dy_, y_, rstd, w_, b, [8], True, True, True, a, 32, 16)
        assert torch.equal(dy_, before)
        return r

    with _Mode():
        assert call(dy.clone()) is None
    assert call(dy.double()) is None
    assert call(dy.clone().transpose(0, 1)) is None

    class Sub(torch.Tensor):
        pass

    assert call(dy.clone().as_subclass(Sub)) is None


@pytest.mark.parametrize("affine", [True, False])
def test_converted_layer_norm_takes_it_with_the_python_body_bits(ext, affine, monkeypatch):
    # a converted LayerNorm before a product, 3 x 29 x 24 (87 rows: 3 row blocks): the loss's
    # gradients with the C++ body equal those with the Python body, and the C++ body ran once
    # per backward
    from slimgrad.nn import LayerNorm

    torch.manual_seed(0)
    ln = LayerNorm(24, elementwise_affine=affine)
    if affine:
        with torch.no_grad():
            ln.weight.uniform_(0.5, 1.5)  # |beta| <= 2 |gamma|: no fallback channel
            ln.bias.uniform_(-0.5, 0.5)
    x = torch.randn(3, 29, 24, requires_grad=True)
    lin = torch.nn.Linear(24, 24)

    def grads():
        (lin(ln(x * 1.5)) ** 2).sum().backward()
        out = [x.grad] + [p.grad for p in ln.parameters()] + [lin.weight.grad]
        x.grad = None
        for p in list(ln.parameters()) + list(lin.parameters()):
            p.grad = None
        return out

    grads()  # the C kernels built, the forward's choice in place
    real, ran = L._EXT_LN_BWD, [0]

    def counted(*args):
        r = real(*args)
        ran[0] += r is not None
        return r

    monkeypatch.setattr(L, "_EXT_LN_BWD", counted)
    got = grads()
    assert ran[0] == 1
    monkeypatch.setattr(L, "_EXT_LN_BWD", None)
    ref = grads()
    for r, g in zip(ref, got, strict=True):
        assert torch.equal(r, g)
