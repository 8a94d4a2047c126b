"""slimgrad._autograd: first_order (NOTE [Second derivatives]) and the torch.func guard."""

import pytest
import torch

from slimgrad import ownership
from slimgrad._autograd import first_order, refuse_jit, transforms_active


def _exp_fn(double=None):
    class _Exp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            y = x.exp()
            ctx.save_for_backward(y)
            return y

        @staticmethod
        @first_order("test.exp", double=double)
        def backward(ctx, g):
            buf = ownership.take(g)
            (y,) = ctx.saved_tensors
            return buf.mul_(y) if buf is not None else g * y

    return _Exp


def test_first_order_wrapper_is_calibrated_for_buffer_reuse():
    fn = _exp_fn()
    x = torch.randn(5, requires_grad=True)
    ownership.reset_reuse_count()
    (fn.apply(x) * 3).sum().backward()
    assert ownership.reuse_count("grad") == 1
    torch.testing.assert_close(x.grad, 3 * x.detach().exp())


def test_second_derivative_without_double_raises_a_slimgrad_error():
    x = torch.randn(5, requires_grad=True)
    (g,) = torch.autograd.grad(_exp_fn().apply(x).sum(), x, create_graph=True)
    torch.testing.assert_close(g, x.detach().exp())  # first derivative still right
    assert g.requires_grad  # never a silent None / no-history result
    with pytest.raises(RuntimeError, match=r"slimgrad\.test\.exp: a second derivative"):
        torch.autograd.grad(g.sum(), x, allow_unused=True)


def test_double_implementation_gives_eager_second_derivative():
    def double(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y  # differentiable: y carries the forward's history

    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(_exp_fn(double).apply(x).sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), x)
    torch.testing.assert_close(gg, x.detach().exp())


def test_nothing_requiring_grad_means_no_history_like_eager():
    class _Scale(torch.autograd.Function):  # y = x * c, c a constant: eager's dx has no history
        @staticmethod
        def forward(ctx, x, c):
            ctx.save_for_backward(c)
            return x * c

        @staticmethod
        @first_order("test.scale")
        def backward(ctx, g):
            (c,) = ctx.saved_tensors
            return g * c, None

    x = torch.randn(5, requires_grad=True)
    (g,) = torch.autograd.grad(_Scale.apply(x, torch.rand(5)).sum(), x, create_graph=True)
    assert not g.requires_grad


def test_transforms_active_and_refuse_jit():
    assert not transforms_active()
    seen = []
    torch.func.grad(lambda t: (seen.append(transforms_active()), t.sin().sum())[1])(torch.ones(3))
    assert seen == [True]
    refuse_jit("test.op")  # not tracing: no error

    def traced(t):
        refuse_jit("test.op")
        return t * 2

    with pytest.raises(RuntimeError, match=r"slimgrad\.test\.op: torch\.jit\.trace"):
        torch.jit.trace(traced, torch.ones(2))


def test_compiling_is_one_frame_and_a_dynamo_constant():
    # NOTE [One-frame compile check]: False in eager, True while Dynamo traces, and no guard on
    # the flag (a guard would fail at run time, where the flag is False: a recompile per call)
    from slimgrad._autograd import compiling

    assert compiling() is False and compiling() == torch.compiler.is_compiling()
    frames = []

    def backend(gm, example_inputs):
        frames.append(gm)
        return gm.forward

    def f(x):
        return x + 1 if compiling() else x - 1

    g = torch.compile(f, backend=backend)
    x = torch.zeros(3)
    for _ in range(3):
        torch.testing.assert_close(g(x), torch.ones(3))
    assert len(frames) == 1
    torch.testing.assert_close(f(x), -torch.ones(3))


def test_ctx_fields_save_and_mark_as_the_methods():
    # NOTE [Saving through ctx's fields]: assigning to_save, non_differentiable and
    # materialize_grads does what save_for_backward, mark_non_differentiable and
    # set_materialize_grads do: the same saved tensors through saved-tensor hooks, the same
    # non-differentiable output, None for a gradient that was not materialized
    from slimgrad._autograd import CTX_FIELDS

    assert CTX_FIELDS  # torch 2.13 has the three fields

    class _Two(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, fields):
            y, m = x * 2, x.detach() + 1
            if fields:
                ctx.to_save, ctx.non_differentiable, ctx.materialize_grads = (x,), (m,), False
            else:
                ctx.save_for_backward(x)
                ctx.mark_non_differentiable(m)
                ctx.set_materialize_grads(False)
            return y, m

        @staticmethod
        def backward(ctx, gy, gm):
            _Two.unmaterialized.append(gm is None)
            (x,) = ctx.saved_tensors
            return gy * x, None

    _Two.unmaterialized = []
    results = []
    for fields in (False, True):
        packed = []
        x = torch.randn(4, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t, packed=packed: (packed.append(t), t)[1], lambda t: t
        ):
            y, m = _Two.apply(x, fields)
        assert not m.requires_grad
        y.sum().backward()
        results.append((len(packed), packed[0] is x, x.grad.clone(), x.detach().clone()))
    (n0, same0, g0, x0), (n1, same1, g1, x1) = results
    assert (n0, same0) == (n1, same1) == (1, True)
    assert _Two.unmaterialized == [True, True]
    torch.testing.assert_close(g0, x0)
    torch.testing.assert_close(g1, x1)
