import pytest
import torch

from slimgrad.memory import measure
from slimgrad.ops.matmul import matmul

SHAPES = [
    ((3,), (3,)),
    ((2, 3), (3,)),
    ((3,), (3, 4)),
    ((5, 2, 3), (3, 4)),
    ((2, 3), (5, 3, 7)),
    ((5, 1, 2, 3), (4, 3, 7)),
    ((0, 3), (3, 2)),
]


def _run(fn, a, b, grads=(True, True), inputs=None):
    a, b = a.clone().requires_grad_(grads[0]), b.clone().requires_grad_(grads[1])
    y = fn(a, b)
    y.backward(torch.ones_like(y), inputs=inputs(a, b) if inputs else None)
    return [y.detach(), a.grad, b.grad]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("sa,sb", SHAPES)
def test_matches_eager(device, dtype, sa, sb):
    a = torch.randn(sa, dtype=dtype, device=device)
    b = torch.randn(sb, dtype=dtype, device=device)
    for o, r in zip(_run(matmul, a, b), _run(torch.matmul, a, b)):
        torch.testing.assert_close(o, r)


@pytest.mark.parametrize("sa,sb", SHAPES[:6])
def test_gradcheck(sa, sb):
    a = torch.randn(sa, dtype=torch.float64, requires_grad=True)
    b = torch.randn(sb, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(matmul, (a, b))
    assert torch.autograd.gradgradcheck(matmul, (a, b))


def test_backward_inputs_subsets_and_memory():
    a, b = torch.randn(4, 5, 6), torch.randn(4, 6, 3)
    for pick in (lambda a, b: [a], lambda a, b: [b]):
        out, ref = _run(matmul, a, b, inputs=pick), _run(torch.matmul, a, b, inputs=pick)
        for o, r in zip(out, ref):
            assert (o is None) == (r is None)
            if o is not None:
                torch.testing.assert_close(o, r)
    bg = b.clone().requires_grad_()
    m = measure(lambda: matmul(a * 1, bg * 1).sum())
    assert m.saved_bytes == a.numel() * 4  # a kept for db; b not needed (a has no grad)
    ag = a.clone().requires_grad_()
    m = measure(lambda: matmul(ag * 1, b * 1).sum())
    assert m.saved_bytes == b.numel() * 4
    assert m.floor_bytes == m.saved_bytes


def test_autocast_compile_errors():
    a, b = torch.randn(3, 4), torch.randn(4, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, ye = matmul(a, b), torch.matmul(a, b)
    assert y.dtype == ye.dtype
    torch.testing.assert_close(y, ye)
    torch._dynamo.reset()
    f = torch.compile(matmul, backend="aot_eager", fullgraph=True)
    for o, r in zip(_run(f, a, b), _run(torch.matmul, a, b)):
        torch.testing.assert_close(o, r)
    with pytest.raises(RuntimeError, match="slimgrad.ops.matmul: both arguments"):
        matmul(torch.tensor(2.0), b)


def test_inplace_on_saved_operand_raises_and_hooks():
    a = torch.randn(3, 4)
    b = torch.randn(4, 2, requires_grad=True)
    y = matmul(a, b)
    a.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    y = matmul(torch.randn(3, 4), b)
    y.retain_grad()
    seen = []
    y.register_hook(seen.append)
    y.sum().backward(retain_graph=True)
    y.sum().backward()
    assert len(seen) == 2 and torch.equal(y.grad, 2 * torch.ones(3, 2))
    an = torch.tensor([[float("nan"), 1.0], [float("inf"), 2.0]])
    torch.testing.assert_close(matmul(an, torch.eye(2)), an @ torch.eye(2), equal_nan=True)
    with torch.inference_mode():
        assert matmul(an, torch.eye(2)).grad_fn is None


@pytest.mark.parametrize(
    "sa,sb", [((5, 5, 0), (0, 5)), ((0, 3), (2, 3, 4)), ((2, 0, 3), (3, 4)), ((4, 0), (0,))]
)
def test_empty_dimensions_match_eager(sa, sb):
    # Issue 15: (5,5,0) @ (0,5) crashed in backward ("cannot reshape tensor of 0 elements");
    # eager returns zero gradients.
    out = _run(matmul, torch.randn(sa), torch.randn(sb))
    ref = _run(torch.matmul, torch.randn(sa), torch.randn(sb))
    for o, e in zip(out, ref, strict=True):
        torch.testing.assert_close(o, e)
        assert o.shape == e.shape


def test_double_backward_and_torch_func():
    # Issue 15: second derivatives as eager's (the backward is differentiable torch ops on the
    # kept operands); torch.func transforms run torch.matmul; torch.jit.trace refuses clearly.
    from torch.func import grad, jacrev, vmap

    d = torch.float64
    for sa, sb in SHAPES + [((5, 5, 0), (0, 5))]:
        a = torch.randn(sa, dtype=d, requires_grad=True)
        b = torch.randn(sb, dtype=d, requires_grad=True)
        assert torch.autograd.gradgradcheck(matmul, (a, b))
    a, b = torch.randn(4, 2, 3), torch.randn(3, 5)
    torch.testing.assert_close(
        vmap(matmul)(a, b.expand(4, 3, 5)), vmap(torch.matmul)(a, b.expand(4, 3, 5))
    )
    torch.testing.assert_close(grad(lambda t: matmul(t, b).sin().sum())(a),
                               grad(lambda t: torch.matmul(t, b).sin().sum())(a))  # fmt: skip
    torch.testing.assert_close(jacrev(matmul)(a[0], b), jacrev(torch.matmul)(a[0], b))
    with pytest.raises(RuntimeError, match="slimgrad.ops.matmul: torch.jit.trace"):
        torch.jit.trace(lambda t: matmul(t, b), a.requires_grad_())
