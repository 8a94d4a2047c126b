"""The ops with the Triton backend forced (TRITON_INTERPRET=1 on CPU): the kernels are really
called, results agree with the PyTorch backend, and the memory contract is unchanged (saved bytes
measured by slimgrad.memory are identical)."""

from __future__ import annotations

import importlib

import pytest
import torch

from slimgrad.kernels import _backend
from slimgrad.memory import measure
from tests.kernels._kern_helpers import interpreted

pytest.importorskip("triton")
pytestmark = [pytest.mark.triton, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

STEMS = [
    "relu", "sigmoid", "tanh", "leaky_relu", "elu", "hardtanh", "gelu", "silu", "mish",
    "dropout", "layer_norm", "rms_norm", "linear_cross_entropy",
]  # fmt: skip


@pytest.fixture(scope="module")
def K():
    with interpreted(*STEMS) as k:
        yield k


@pytest.fixture
def spy(K, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv(_backend.ENV_VAR, raising=False)
    calls = []

    def watch(stem):
        mod = getattr(K, stem)
        for name in (
            "_fwd_triton",
            "_fwd_triton_",
            "_fwd_inplace_triton",
            "_bwd_triton",
            "_fwd_grad_triton",
        ):
            fn = getattr(mod, name, None)
            if fn is not None:

                def wrapped(*a, _fn=fn, _name=name, **kw):
                    calls.append(f"{stem}.{_name}")
                    return _fn(*a, **kw)

                monkeypatch.setattr(mod, name, wrapped)
        return calls

    return watch


def _op(stem):
    return importlib.import_module(f"slimgrad.ops.{stem}")


def _cases():
    lin = torch.nn.Linear(13, 29)
    return {
        "relu": lambda x: _op("relu").relu(x),
        "sigmoid": lambda x: _op("sigmoid").sigmoid(x),
        "tanh": lambda x: _op("tanh").tanh(x),
        "leaky_relu": lambda x: _op("leaky_relu").leaky_relu(x, 0.2),
        "elu": lambda x: _op("elu").elu(x, 0.5),
        "hardtanh": lambda x: _op("hardtanh").hardtanh(x, -0.5, 0.75),
        "gelu": lambda x: _op("gelu").gelu(x, "tanh"),
        "silu": lambda x: _op("silu").silu(x),
        "mish": lambda x: _op("mish").mish(x),
        "layer_norm": lambda x: _op("layer_norm").layer_norm(
            x, (13,), torch.full((13,), 1.5), torch.full((13,), 0.1)
        ),
        "rms_norm": lambda x: _op("rms_norm").rms_norm(x, (13,), torch.full((13,), 0.7)),
        "linear_cross_entropy": lambda x: _op("linear_cross_entropy").linear_cross_entropy(
            x, lin.weight, torch.arange(x.shape[0]) % 29, bias=lin.bias
        ),
        "linear_cross_entropy[precompute]": lambda x: _op(
            "linear_cross_entropy"
        ).linear_cross_entropy(
            # a frozen weight: precompute applies at any token count (dW would need N >= H)
            x,
            lin.weight.detach(),
            torch.arange(x.shape[0]) % 29,
            precompute_grads=True,
        ),
    }


@pytest.mark.parametrize("stem", list(_cases()))
def test_op_runs_kernels_same_results_same_memory(spy, stem):
    fn = _cases()[stem]
    calls = spy(stem.split("[")[0])
    # N(0,1): few hard elements, no dense fallback for gelu/silu/mish; more than DENSE_MAX (512)
    # elements for them and for elu/hardswish/hardsigmoid (a few elements keep x: NOTE [Few
    # elements] in slimgrad.ops._output_act)
    few_kept = ("gelu", "silu", "mish", "elu", "hardswish", "hardsigmoid")
    x0 = torch.randn(41, 13) if stem.split("[")[0] in few_kept else torch.randn(11, 13)
    res = {}
    for backend in ("torch", "triton"):
        with _backend.set_backend(backend):
            xg = x0.clone().requires_grad_()
            y = fn(xg * 1)
            (gx,) = torch.autograd.grad(y.sum() if y.dim() else y, xg)
            m = measure(lambda: fn(x0.clone().requires_grad_() * 1).sum())
            res[backend] = (y.detach(), gx, m.saved_bytes, m.saved_input_bytes)
    if stem.endswith("[precompute]"):  # gradients computed in forward: backward only scales them
        assert "linear_cross_entropy._fwd_grad_triton" in calls, calls
    else:
        assert any(c.endswith("_fwd_triton") for c in calls), calls
        assert any(c.endswith("_bwd_triton") for c in calls), calls
    (yt, gt, st, sit), (yk, gk, sk, sik) = res["torch"], res["triton"]
    torch.testing.assert_close(yk, yt, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(gk, gt, rtol=2e-5, atol=2e-6)
    assert (sk, sik) == (st, sit)


def test_dropout_needs_explicit_triton(spy):
    calls = spy("dropout")
    drop = _op("dropout").dropout
    x = torch.randn(7, 9, requires_grad=True)
    drop(x * 1, 0.3).sum().backward()
    assert calls == []  # auto keeps eager's masks (no CUDA here anyway)
    with _backend.set_backend("triton"):
        x.grad = None
        y = drop(x * 1, 0.3)
        y.sum().backward()
        m = measure(lambda: drop(torch.randn(7, 9, requires_grad=True) * 1, 0.3).sum())
    assert calls == ["dropout._fwd_triton", "dropout._bwd_triton"] * 2
    keep = y.detach() != 0
    torch.testing.assert_close(x.grad, keep.float() / 0.7)
    assert m.saved_bytes == (63 + 7) // 8  # the packed mask only


def test_dropout_inplace_triton_and_autograd_sees_the_write(spy):
    calls = spy("dropout")
    drop_ = _op("dropout").dropout_
    with _backend.set_backend("triton"):
        a = torch.randn(5, 8, requires_grad=True)
        h = a * 1
        s = h.sin()  # saves h
        drop_(h, 0.5)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            s.sum().backward()
    assert calls[0] == "dropout._fwd_inplace_triton"


def test_inplace_activation_triton_and_autograd_sees_the_write(spy):
    calls = spy("relu")
    with _backend.set_backend("triton"):
        a = torch.randn(5, 8, requires_grad=True)
        h = a * 1
        s = h.sin()
        _op("relu").relu_(h)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            s.sum().backward()
    assert "relu._fwd_triton_" in calls


def test_compiled_ops_run_the_kernels_at_run_time(spy):
    # custom ops are opaque to torch.compile: their Python body runs at run time and picks Triton
    calls = spy("gelu")
    spy("layer_norm")  # the same list
    gelu, layer_norm = _op("gelu").gelu, _op("layer_norm").layer_norm

    def f(x, w):
        return layer_norm(gelu(x), (13,), w, None).sum()

    x0, w0 = torch.randn(41, 13), torch.rand(13) + 0.5  # > 512 elements: gelu's table path
    res = []
    for backend in ("torch", "triton"):
        with _backend.set_backend(backend):
            x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
            torch.compile(f, backend="aot_eager", fullgraph=True)(x, w).backward()
            res.append((x.grad, w.grad))
    assert {"gelu._fwd_triton", "gelu._bwd_triton", "layer_norm._fwd_triton"} <= set(calls)
    torch.testing.assert_close(res[1], res[0], rtol=2e-5, atol=2e-6)


def test_dropout_backward_uses_the_forwards_kernels(spy):
    # the straight path keeps the forward's choice in ctx: a forward under 'triton' runs the Triton
    # backward even when the process-wide name changed before backward (its mask came from the
    # Philox kernel); a forward under 'torch' keeps the PyTorch backward under 'triton'
    calls = spy("dropout")
    drop = _op("dropout").dropout
    x = torch.randn(7, 9, requires_grad=True)
    with _backend.set_backend("triton"):
        y = drop(x * 1, 0.3)
    with _backend.set_backend("torch"):
        y.sum().backward()
    assert calls == ["dropout._fwd_triton", "dropout._bwd_triton"]
    torch.testing.assert_close(x.grad, (y.detach() != 0).float() / 0.7)
    calls.clear()
    with _backend.set_backend("torch"):
        y = drop(x * 1, 0.3)
    with _backend.set_backend("triton"):
        y.sum().backward()
    assert calls == []
