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
