"""Issue 30: an op that keeps its output y (where eager keeps x) and user code that writes y after
forward, inside a saved-tensor-hooks region (NOTE [A kept output written under saved-tensor hooks]
in slimgrad/_errors.py).

Autograd skips its version check on tensors a hook hands back, so a hook returning y itself
(identity hooks, ``save_on_cpu`` on CPU tensors) or an alias of it gave backward the written
values: a wrong gradient (LeakyReLU off by 0.561, LayerNorm by 70.4 on the issue's repro). Each
op class that keeps its output, on each path it has (the C kernels and the PyTorch path, the HF
Llama RMSNorm's C++ node and Python Function), under each hook kind, written or not:

- not written: the gradients of unhooked slimgrad, bit for bit;
- written, a hook that hands back y or an alias (identity, ``save_on_cpu``, ``detach``):
  slimgrad's error, as without hooks;
- written, a hook that copied y at pack (a clone, a CPU clone, bytes): backward reads forward's
  values, so the gradient is eager's (the unwritten one, bit for bit) and no error.

Ops whose eager op keeps y too (relu, tanh, in-place leaky_relu) give eager's gradient bit for
bit even from a written y: eager reads the written y under those hooks as well. The smooth
activations (GELU, SiLU, Mish) keep x under these hooks (in place, x's copy), as eager (NOTE
[Under hooks that pack each tensor] in slimgrad/ops/_output_act.py): eager's gradient bit for bit,
written or not, and slimgrad's error only without hooks.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad import _errors
from slimgrad.kernels import _backend
from slimgrad.testing import assert_within_rule

WRITTEN = (
    r"slimgrad\.ops\.{}: one of the variables needed for gradient computation has been modified"
)


def _identity():
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


def _detach():
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach(), lambda t: t)


def _clone():
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t)


def _cpu_clone():  # torchtune-style offload, on CPU: a copy made at pack, moved back at unpack
    def pack(t):
        return t.device, t.to("cpu", copy=True)

    def unpack(p):
        return p[1].to(p[0])

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _bytes():  # pack to bytes, rebuild at unpack
    def pack(t):
        return t.shape, t.dtype, t.detach().contiguous().numpy().tobytes()

    def unpack(p):
        if not p[2]:  # frombuffer refuses an empty buffer
            return torch.empty(p[0], dtype=p[1])
        return torch.frombuffer(bytearray(p[2]), dtype=p[1]).reshape(p[0])

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


SAME = {"identity": _identity, "save_on_cpu": torch.autograd.graph.save_on_cpu, "detach": _detach}
COPY = {"clone": _clone, "cpu_clone": _cpu_clone, "bytes": _bytes}

# (op, torch module, input shape, slimgrad api stem); each keeps y where eager keeps x
OPS = {
    "leaky_relu": (lambda: nn.LeakyReLU(0.1), (32, 64), "leaky_relu"),
    "relu6": (nn.ReLU6, (32, 64), "hardtanh"),
    "hardtanh": (lambda: nn.Hardtanh(-0.5, 0.5), (32, 64), "hardtanh"),
    "gelu": (nn.GELU, (32, 64), "gelu"),
    "gelu_tanh": (lambda: nn.GELU("tanh"), (32, 64), "gelu"),
    "silu": (nn.SiLU, (32, 64), "silu"),
    "silu_inplace": (lambda: nn.SiLU(inplace=True), (32, 64), "silu"),
    "mish": (nn.Mish, (32, 64), "mish"),
    "layer_norm": (lambda: nn.LayerNorm(64), (32, 64), "layer_norm"),
    "rms_norm": (lambda: nn.RMSNorm(64), (32, 64), "rms_norm"),
    "group_norm": (lambda: nn.GroupNorm(4, 16), (4, 16, 5, 7), "group_norm"),
}
# under hooks that pack each tensor these keep x (in place, x's copy) as eager does
KEEP_X_UNDER_HOOKS = ("gelu", "gelu_tanh", "silu", "silu_inplace", "mish")
# paths: "auto" takes the C kernels where they exist (smooth activations, LayerNorm, GroupNorm's
# backward), "torch" the PyTorch path
BACKENDS = ("auto", "torch")


def _converted(make, shape):
    torch.manual_seed(0)
    c = shape[1]
    if len(shape) == 2:
        m = nn.Sequential(nn.Linear(c, c), make(), nn.Linear(c, c))
    else:
        m = nn.Sequential(nn.Conv2d(c, c, 1), make(), nn.Conv2d(c, c, 1))
    slimgrad.convert_(m)
    assert type(m[1]).__module__.startswith("slimgrad."), type(m[1])
    return m[1]


def _grads(op, x0, ctx, write: bool):
    # y used through a product with a constant (which keeps the constant, not y), so only the op
    # keeps y; a write over y then reaches nothing but the op's own saved output
    torch.manual_seed(1)
    x = x0.clone().requires_grad_()
    c = torch.randn(x.shape)
    params = list(op.parameters())
    with ctx():
        h = x * 1.0  # the op's input: a non-leaf (in-place ops write it)
        y = op(h)
        loss = (y * c).sum()
        if write:
            y.add_(1.0)
        loss.backward()
    return [x.grad] + [p.grad for p in params]


def _x(shape):
    torch.manual_seed(2)
    return torch.randn(shape)


def _eager_grads(name, x, hooks, write: bool):
    # eager's op under the same hooks (the weights of _converted's op: it has none)
    make, shape, _ = OPS[name]
    torch.manual_seed(0)
    return _grads(make(), x, hooks, write)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(OPS))
def test_hooks_without_a_write_change_nothing(name, backend):
    make, shape, _ = OPS[name]
    x = _x(shape)
    with _backend.set_backend(backend):
        ref = _grads(_converted(make, shape), x, contextlib.nullcontext, False)
        for hooks in (*SAME.values(), *COPY.values()):
            got = _grads(_converted(make, shape), x, hooks, False)
            if name in KEEP_X_UNDER_HOOKS:  # x kept, as eager: eager's gradient
                ref = _eager_grads(name, x, hooks, False)
            for a, b in zip(got, ref, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hooks", list(SAME))
@pytest.mark.parametrize("name", list(OPS))
def test_written_output_handed_back_by_a_hook_raises(name, hooks, backend):
    make, shape, api = OPS[name]
    x = _x(shape)
    with _backend.set_backend(backend):
        op = _converted(make, shape)
        if name in KEEP_X_UNDER_HOOKS:  # x kept, as eager: the write reaches no saved tensor
            got = _grads(op, x, SAME[hooks], True)
            ref = _eager_grads(name, x, SAME[hooks], True)
            for a, b in zip(got, ref, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
        else:
            with pytest.raises(RuntimeError, match=WRITTEN.format(api)) as e:
                _grads(op, x, SAME[hooks], True)
            assert "It keeps its output for backward where eager keeps its input" in str(e.value)
    with _backend.set_backend(backend):  # and without hooks, the same error (autograd's check)
        with pytest.raises(RuntimeError, match=WRITTEN.format(api)):
            _grads(_converted(make, shape), x, contextlib.nullcontext, True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hooks", list(COPY))
@pytest.mark.parametrize("name", list(OPS))
def test_written_output_copied_at_pack_gives_eagers_gradient(name, hooks, backend):
    # the copy holds forward's values: the gradient is the unwritten one (bit for bit), and eager's
    # within the error rule (eager keeps x, which the write does not touch)
    make, shape, _ = OPS[name]
    x = _x(shape)
    with _backend.set_backend(backend):
        ref = _grads(_converted(make, shape), x, contextlib.nullcontext, False)
        got = _grads(_converted(make, shape), x, COPY[hooks], True)
    if name in KEEP_X_UNDER_HOOKS:  # x kept, as eager: eager's gradient
        ref = _eager_grads(name, x, COPY[hooks], True)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.manual_seed(0)
    eager = make()
    eager64 = make().double()
    eager64.load_state_dict(eager.state_dict())
    ge = _grads(eager, x, COPY[hooks], True)
    g64 = _grads(eager64, x.double(), COPY[hooks], True)
    assert_within_rule(got, g64, ge)


@pytest.mark.parametrize("hooks", list(SAME))
@pytest.mark.parametrize("make", [nn.ReLU, nn.Tanh, lambda: nn.LeakyReLU(0.1, inplace=True)])
def test_ops_whose_eager_keeps_y_match_eager_under_hooks(make, hooks):
    # eager's op keeps y as well: a written y reaches eager's backward through these hooks too, so
    # slimgrad gives eager's gradient (bit for bit), not an error eager does not raise
    x = _x((32, 64))
    torch.manual_seed(0)
    eager = make()
    got = _grads(_converted(make, (32, 64)), x, SAME[hooks], True)
    ref = _grads(eager, x, SAME[hooks], True)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _llama_norm():
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm(64)


def test_llama_rms_norm_node_written_output_raises_slimgrads_error():
    # the fp32 HF Llama RMSNorm's C++ node (no hooks): its output written after forward gave
    # autograd's plain in-place error; now slimgrad's, as the Python Function's
    rms = _sys_module("slimgrad.ops.rms_norm")
    if rms._EXT_NODE is None:
        pytest.skip(f"the C++ node is not built here ({slimgrad._ext.error()})")
    op = _converted(_llama_norm, (32, 64))
    x = _x((32, 64))
    op(x.clone().requires_grad_()).sum().backward()  # the extension loaded
    h = x.clone().requires_grad_()
    y = op(h * 1.0)
    assert "HFRMSNormNode" in y.grad_fn.name()
    loss = (y * 2.0).sum()
    y.add_(1.0)
    with pytest.raises(RuntimeError, match=WRITTEN.format("rms_norm")) as e:
        loss.backward()
    assert "It keeps its output for backward" in str(e.value)


def test_llama_rms_norm_node_written_weight_keeps_autograds_error():
    rms = _sys_module("slimgrad.ops.rms_norm")
    if rms._EXT_NODE is None:
        pytest.skip("the C++ node is not built here")
    op = _converted(_llama_norm, (32, 64))
    x = _x((32, 64))
    op(x.clone().requires_grad_()).sum().backward()
    y = op(x.clone().requires_grad_() * 1.0)
    assert "HFRMSNormNode" in y.grad_fn.name()
    with torch.no_grad():
        op.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="^one of the variables needed"):
        y.sum().backward()


@pytest.mark.parametrize("hooks", [*SAME, *COPY])
def test_llama_rms_norm_under_hooks(hooks):
    # under hooks the node is not made: the Python Function, recording y
    make, shape = _llama_norm, (32, 64)
    x = _x(shape)
    ref = _grads(_converted(make, shape), x, contextlib.nullcontext, False)
    hk = SAME.get(hooks) or COPY[hooks]
    got = _grads(_converted(make, shape), x, hk, False)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    if hooks in SAME:
        with pytest.raises(RuntimeError, match=WRITTEN.format("rms_norm")):
            _grads(_converted(make, shape), x, hk, True)
    else:
        got = _grads(_converted(make, shape), x, hk, True)
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_dirty_tensors_get_one_bump_when_the_forward_returns():
    # _errors.DIRTY_BUMP: what autograd adds to a tensor the forward marked dirty, after the
    # forward returns (an in-place op's recorded version counts it)
    seen = []

    class _Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            x.mul_(2.0)
            ctx.mark_dirty(x)
            seen.append(x._version)
            return x

        @staticmethod
        def backward(ctx, g):
            return g

    for view in (False, True):
        b = torch.randn(6, requires_grad=True) * 1.0
        y = _Fn.apply(b[:3] if view else b)
        assert y._version == seen[-1] + _errors.DIRTY_BUMP


def test_unhooked_forward_records_nothing():
    # outside a hooks region the forward stores None: backward compares nothing
    op = _converted(lambda: nn.LeakyReLU(0.1), (32, 64))
    y = op(_x((32, 64)).requires_grad_() * 1.0)
    assert y.grad_fn.y_seen is None
    with _identity():
        y = op(_x((32, 64)).requires_grad_() * 1.0)
    assert y.grad_fn.y_seen is not None


def test_inference_mode_under_hooks_runs():
    # an inference tensor has no version counter: nothing is recorded (and nothing saved)
    op = _converted(lambda: nn.LayerNorm(64), (32, 64))
    with torch.inference_mode(), _identity():
        y = op(_x((32, 64)))
    assert y.shape == (32, 64)


def _sys_module(name):
    import sys

    return sys.modules[name]
