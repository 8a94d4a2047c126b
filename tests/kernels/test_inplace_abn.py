"""Triton kernels of In-Place ABN against the PyTorch path, under TRITON_INTERPRET=1 (CPU); the op
with the Triton backend forced. The kernels compiled for sm_90 without a GPU: tests/kernels/
test_backend.py (test_inplace_abn_kernels_compile_for_sm90, in its fresh child)."""

from __future__ import annotations

import importlib

import pytest
import torch

from slimgrad.kernels import _backend
from slimgrad.memory import measure
from tests.kernels._kern_helpers import interpreted
from tests.ops._inplace_abn_helpers import check_backends


@pytest.fixture(autouse=True)
def _in_place_at_any_count(monkeypatch):
    # these tests use small shapes for the op's own path: let it run at any count per channel
    # (NOTE [Few values per channel in InPlaceABN]; tests/ops/test_abn_few_values.py covers that)
    monkeypatch.setattr(importlib.import_module("slimgrad.ops.inplace_abn"), "_MAX_FEW", 0)


ref = importlib.import_module("slimgrad.ops.inplace_abn")


pytest.importorskip("triton")
pytestmark = pytest.mark.triton

ACTS = [("identity", 0.0), ("leaky_relu", 0.1), ("elu", 1.0)]


@pytest.fixture(scope="module")
def K():
    # NOTE [Kernels under the interpreter]: the flag is set, then the kernels are (re)imported
    with interpreted("inplace_abn") as k:
        yield k.inplace_abn


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


def test_backward_reduction_split_over_parts(K, monkeypatch):
    # several (channel, part) programs per channel: partial sums added in float64 by the caller
    monkeypatch.setattr(K, "_BLOCK", 16)
    monkeypatch.setattr(K, "_PROGRAMS", 64)
    assert K._split(3, 5 * 41) == (4, 64)  # 4 parts of 64 values per channel of 205
    x, w, b = _case((5, 3, 41), torch.float32)
    z = x.clone()
    _, invstd, idx, side, count = ref._fwd_torch(z, w, b, None, None, True, 0.1, 1e-5, "elu", 1.0)
    dz = torch.randn_like(z)
    args = (z, dz, w, b, invstd, idx, side, count, True, 1e-5, "elu", 1.0)
    for a, r in zip(K._bwd_triton(*args), ref._bwd_torch(*args)):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)


def test_elu_rebuild_keeps_small_preactivations(K):
    # pre-activations in (-1e-5, 0): log(1 + z) would lose up to 3e-8 to the rounding of 1 + z
    # (~1% of x̂ here, 2e-4 of dweight); log1p's form keeps dweight = sum(dy * x̂) to float32
    y = -torch.rand(2, 1, 300, dtype=torch.float64) * 1e-5
    z = torch.expm1(y).float()  # elu(y), alpha 1
    w, b = torch.ones(1), torch.zeros(1)
    dz = torch.rand_like(z) + 0.5
    idx, side = torch.zeros(0, dtype=torch.long), torch.empty(2, 0, 300)
    args = (z, dz, w, b, torch.ones(1), idx, side, 600, False, 1e-5, "elu", 1.0, False, True)
    _, dw, db = K._bwd_triton(*args)
    _, dw_ref, db_ref = ref._bwd_torch(*args)
    torch.testing.assert_close(dw, dw_ref, rtol=1e-5, atol=0)
    torch.testing.assert_close(db, db_ref, rtol=1e-6, atol=0)


def test_forward_with_merge_matches_torch(K):
    # the sync variant's forward: statistics merged by a hook (here: the other rank is a copy)
    def merge(n, mean, var):
        return 2 * n, mean, var

    x, w, b = _case((3, 4, 5), torch.float32)
    rm, rv = torch.zeros(4), torch.ones(4)
    rm2, rv2 = rm.clone(), rv.clone()
    xa, xb = x.clone(), x.clone()
    got = K._fwd_triton(xa, w, b, rm, rv, True, 0.1, 1e-5, "leaky_relu", 0.1, merge)
    want = ref._fwd_torch(xb, w, b, rm2, rv2, True, 0.1, 1e-5, "leaky_relu", 0.1, merge)
    torch.testing.assert_close(xa, xb)
    assert got[4] == want[4] == 30
    torch.testing.assert_close((rm, rv), (rm2, rv2))


def test_apply_refuses_float64(K):
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    assert not K.apply_(x, torch.ones(3), torch.zeros(3), "identity", 0.0)


# ---------------------------------------------------------------------------------------------
# The op through the backend choice (NOTE [Kernel backend choice])


@pytest.fixture
def spy(K, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv(_backend.ENV_VAR, raising=False)
    calls = []
    for name in ("_fwd_triton", "_bwd_triton", "apply_"):
        fn = getattr(K, name)

        def wrapped(*a, _fn=fn, _name=name, **kw):
            calls.append(_name)
            return _fn(*a, **kw)

        monkeypatch.setattr(K, name, wrapped)
    return calls


def _abn_step(x0, w0, b0, act, param, training=True):
    x = x0.clone().requires_grad_()
    w, b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
    rm, rv = torch.zeros(x0.shape[1]), torch.ones(x0.shape[1])
    z = ref.inplace_abn(x * 1, rm, rv, w, b, training, 0.1, 1e-5, act, param)
    g = torch.linspace(-1, 1, z.numel()).view_as(z)
    torch.autograd.backward(z, g, inputs=[x, w, b])
    return z.detach(), x.grad, w.grad, b.grad, rm, rv


@pytest.mark.parametrize(
    "act,param,training", [("identity", 0.0, True), ("leaky_relu", 0.1, False), ("elu", 1.0, True)]
)
def test_op_backend_choice(spy, act, param, training):
    x0, w0, b0 = _case((4, 5, 3, 3), torch.float32, zero_channel=True)
    res = {}
    for backend in ("torch", "triton"):
        with _backend.set_backend(backend):
            res[backend] = _abn_step(x0, w0, b0, act, param, training)
            m = measure(lambda: ref.inplace_abn(
                x0.clone().requires_grad_() * 1, None, None, w0, b0, True, 0.1, 1e-5, act, param
            ).sum())  # fmt: skip
            res[backend] += (m.saved_bytes, m.saved_input_bytes)
    assert spy == ["_bwd_triton"] * 2  # eager forward on both backends; backward by the kernels
    (zt, *gt, rmt, rvt, st, sit), (zk, *gk, rmk, rvk, sk, sik) = res["torch"], res["triton"]
    assert torch.equal(zk, zt)  # NOTE [Same forward as eager]: bit for bit on both backends
    assert torch.equal(rmk, rmt) and torch.equal(rvk, rvt)
    for a, r in zip(gk, gt):
        torch.testing.assert_close(a, r, rtol=2e-5, atol=2e-6)
    assert (sk, sik) == (st, sit)  # the memory contract does not depend on the backend


@pytest.mark.parametrize(
    "act,param,dtype,channels_last",
    [("leaky_relu", 0.01, torch.float32, False), ("elu", 1.0, torch.float16, True),
     ("identity", 0.0, torch.float32, True)],
)  # fmt: skip
def test_op_both_backends_match_eager(spy, act, param, dtype, channels_last):
    # the check tests/ops/test_inplace_abn.py runs on CUDA, here with the interpreted kernels
    check_backends(torch.device("cpu"), act, param, dtype, channels_last)
    assert spy == ["_bwd_triton"]


def test_op_triton_forward_under_compile(spy):
    # torch.compile runs the registered ops; their bodies pick the kernels at run time
    torch._dynamo.reset()
    x0, w0, b0 = _case((3, 4, 5), torch.float32)

    def f(x, w, b):
        return ref.inplace_abn(x * 1, None, None, w, b, True, 0.1, 1e-5, "leaky_relu", 0.1)

    res = []
    for backend in ("torch", "triton"):
        with _backend.set_backend(backend):
            x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
            z = torch.compile(f, backend="aot_eager", fullgraph=True)(x, w, b)
            z.backward(torch.ones_like(z))
            res.append((z.detach(), x.grad, w.grad, b.grad))
    assert {"apply_", "_bwd_triton"} <= set(spy), spy
    torch.testing.assert_close(res[1], res[0], rtol=2e-5, atol=2e-6)
