"""Triton kernels of In-Place ABN against the PyTorch path, under TRITON_INTERPRET=1 (CPU)."""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

ref = importlib.import_module("slimgrad.ops.inplace_abn")


pytest.importorskip("triton")
pytestmark = pytest.mark.triton

ACTS = [("identity", 0.0), ("leaky_relu", 0.1), ("elu", 1.0)]


@pytest.fixture(scope="module")
def K():
    # The interpreter is chosen when a kernel is decorated: set the flag, then (re)import.
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    name = "slimgrad.kernels.inplace_abn"
    mod = (
        importlib.reload(sys.modules[name])
        if name in sys.modules
        else importlib.import_module(name)
    )
    yield mod
    if old is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = old
    sys.modules.pop(name, None)


def _case(shape, dtype, zero_channel=False, channels_last=False):
    torch.manual_seed(0)
    c = shape[1]
    x = (torch.randn(shape) * 2 + 0.5).to(dtype)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w = torch.rand(c) + 0.5
    w[0] = -w[0]
    b = torch.randn(c) * 0.2
    if zero_channel:
        w[1] = 0.0
    return x, w, b


@pytest.mark.parametrize("act,param", ACTS)
@pytest.mark.parametrize(
    "training,shape,channels_last",
    [(True, (3, 5, 7), False), (True, (2, 3, 5, 3), True), (False, (4, 6), False)],
)
def test_forward_matches_torch(K, act, param, training, shape, channels_last):
    x, w, b = _case(shape, torch.float32, channels_last=channels_last)
    c = shape[1]
    rm, rv = torch.zeros(c), torch.ones(c)
    rm2, rv2 = rm.clone(), rv.clone()
    xa, xb = x.clone(), x.clone()
    got = K._fwd_triton(xa, w, b, rm, rv, training, 0.1, 1e-5, act, param)
    want = ref._fwd_torch(xb, w, b, rm2, rv2, training, 0.1, 1e-5, act, param)
    torch.testing.assert_close(xa, xb)
    assert xa.stride() == xb.stride()
    for a, r in zip(got[:4], want[:4]):
        torch.testing.assert_close(a, r)
    torch.testing.assert_close((rm, rv), (rm2, rv2))


@pytest.mark.parametrize("act,param", ACTS)
@pytest.mark.parametrize(
    "training,zero_channel,shape,channels_last",
    [
        (True, False, (3, 5, 7), False),
        (True, True, (2, 3, 5, 3), True),
        (False, True, (3, 4), False),
    ],
)
def test_backward_matches_torch(K, act, param, training, zero_channel, shape, channels_last):
    x, w, b = _case(shape, torch.float32, zero_channel, channels_last)
    c = shape[1]
    rm, rv = torch.zeros(c), torch.ones(c)
    z = x.clone()
    _, invstd, side_idx, side_xhat, count = ref._fwd_torch(
        z, w, b, rm, rv, training, 0.1, 1e-5, act, param
    )
    assert (side_idx.numel() > 0) == zero_channel
    dz = torch.randn_like(z)
    args = (z, dz, w, b, invstd, side_idx, side_xhat, count, training, 1e-5, act, param)
    got = K._bwd_triton(*args)
    want = ref._bwd_torch(*args)
    for a, r in zip(got, want):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)
    if channels_last:
        assert got[0].is_contiguous(memory_format=torch.channels_last)


def test_backward_bf16_within_rule_of_torch_path(K):
    x, w, b = _case((4, 3, 9), torch.bfloat16)
    z = x.clone()
    _, invstd, side_idx, side_xhat, count = ref._fwd_torch(
        z, w, b, None, None, True, 0.1, 1e-5, "leaky_relu", 0.1
    )
    dz = torch.randn_like(z)
    args = (z, dz, w, b, invstd, side_idx, side_xhat, count, True, 1e-5, "leaky_relu", 0.1)
    got, want = K._bwd_triton(*args), ref._bwd_torch(*args)
    assert got[0].dtype == torch.bfloat16
    torch.testing.assert_close(got[0], want[0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got[1:], want[1:], rtol=1e-4, atol=1e-4)


def test_sync_allreduce_hook_is_used(K):
    # a fake two-rank all-reduce (the other rank sees the same data): sums double, count doubles
    x, w, b = _case((3, 4, 5), torch.float32)
    z = x.clone()
    _, invstd, idx, side, count = ref._fwd_torch(z, w, b, None, None, True, 0.1, 1e-5, "elu", 1.0)
    dz = torch.randn_like(z)

    def allreduce(sdy, sdyx, n):
        return 2 * sdy, 2 * sdyx, 2 * n

    args = (z, dz, w, b, invstd, idx, side, count, True, 1e-5, "elu", 1.0, True, True)
    got = K._bwd_triton(*args, allreduce=allreduce)
    want = ref._bwd_torch(*args, allreduce=allreduce)
    for a, r in zip(got, want):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)
