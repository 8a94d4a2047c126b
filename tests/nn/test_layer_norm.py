import pytest
import torch

from slimgrad.nn.layer_norm import LayerNorm


@pytest.mark.parametrize("kw", [{}, {"elementwise_affine": False}, {"bias": False}, {"eps": 1e-3}])
def test_same_args_state_dict_and_values(kw):
    ref = torch.nn.LayerNorm((3, 7), **kw)
    if ref.weight is not None:
        torch.nn.init.normal_(ref.weight, 1.0, 0.2)
    ours = LayerNorm((3, 7), **kw)
    assert list(ours.state_dict()) == list(ref.state_dict())
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(5, 3, 7, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, y2 = ours(x), ref(x2)
    torch.testing.assert_close(y, y2)
    g = torch.randn_like(y)
    y.backward(g)
    y2.backward(g)
    torch.testing.assert_close(x.grad, x2.grad)
    assert repr(ours) == repr(ref)


def test_from_torch_shares_parameters():
    ref = torch.nn.LayerNorm(6).train(False)
    ours = LayerNorm.from_torch(ref)
    assert ours.weight is ref.weight and ours.bias is ref.bias and not ours.training
    assert ours.eps == ref.eps and ours.normalized_shape == ref.normalized_shape
    ours(torch.randn(2, 6)).sum().backward()
    assert ref.weight.grad is not None
    with pytest.raises(TypeError, match="slimgrad.nn.LayerNorm.from_torch: expected a torch.nn"):
        LayerNorm.from_torch(torch.nn.Linear(2, 2))


def test_fallback_channels_follow_the_weights_between_calls():
    # the module's straight path keeps no index table when no channel falls back, and finds the
    # channels again after each in-place write (version), an optimizer step and a .data swap:
    # gradients stay eager's (finite) when a weight channel becomes 0 between calls
    torch.manual_seed(0)
    ours = LayerNorm(6)
    ref = torch.nn.LayerNorm(6)
    x = torch.randn(4, 6)

    def grads(m):
        xi = x.clone().requires_grad_()
        m.zero_grad()
        m(xi * 1).backward(torch.arange(24.0).reshape(4, 6))
        return xi.grad, m.weight.grad.clone(), m.bias.grad.clone()

    def check():
        ref.load_state_dict(ours.state_dict())
        for a, e in zip(grads(ours), grads(ref), strict=True):
            assert torch.isfinite(a).all()
            torch.testing.assert_close(a, e)

    check()
    y = ours(x.detach().requires_grad_())
    assert len(y.grad_fn.saved_tensors) == 7 and y.grad_fn.saved_tensors[3] is None
    with torch.no_grad():
        ours.weight[2] = 0.0  # a version bump
    check()
    with torch.no_grad():
        ours.weight.fill_(1.0)
    check()
    ours.weight.data = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 1.0])  # no version bump
    check()
    ours.weight.grad = torch.zeros(6)
    ours.weight.grad[3] = 1.0
    with torch.no_grad():
        ours.weight.data[3] = 1e-3  # no version bump; then a step renews the decision
        torch.optim.Adam([ours.weight], lr=1e-3, fused=True).step()
    check()


def test_forward_and_its_inline_copy_of_the_straight_path_agree():
    # LayerNorm.forward repeats ops.layer_norm's _layer_norm_straight inline: the same output,
    # the same saved tensors and the same second derivatives (no anchor: NOTE [LayerNorm's second
    # derivatives through its own node]) at every input kind it branches on
    from slimgrad.ops.layer_norm import layer_norm

    for dtype, inf in ((torch.float32, False), (torch.float32, True), (torch.float64, False)):
        ln = LayerNorm(16, dtype=dtype)
        with torch.no_grad():
            ln.weight.uniform_(0.5, 1.5)
            if inf:
                ln.weight[3] = float("inf")
        x = torch.randn(4, 16, dtype=dtype, requires_grad=True)
        ys = [ln(x), layer_norm(x, (16,), ln.weight, ln.bias, ln.eps)]
        assert torch.equal(ys[0], ys[1])
        assert type(ys[0].grad_fn) is type(ys[1].grad_fn)
        saved = [[s for s in y.grad_fn.saved_tensors if s is not None] for y in ys]
        assert len(saved[0]) == len(saved[1])
        assert all(torch.equal(a, b) for a, b in zip(*saved))
        assert [hasattr(y.grad_fn, "_slimgrad_anchor") for y in ys] == [False, False]
        hvps = []
        for y in ys:
            (g,) = torch.autograd.grad((y * y.detach().cos()).sum(), x, create_graph=True)
            hvps.append(torch.autograd.grad(g.square().sum(), (x, ln.weight), allow_unused=True))
        for a, b in zip(*hvps):  # an inf weight gives NaN, as eager's
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
