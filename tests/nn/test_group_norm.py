import pytest
import torch

from slimgrad.nn.group_norm import GroupNorm


@pytest.mark.parametrize("affine", [True, False])
def test_same_state_dict_values_and_from_torch(affine):
    ref = torch.nn.GroupNorm(2, 6, affine=affine)
    ours = GroupNorm(2, 6, affine=affine)
    assert list(ours.state_dict()) == list(ref.state_dict()) and repr(ours) == repr(ref)
    shared = GroupNorm.from_torch(ref)
    assert shared.weight is ref.weight
    x = torch.randn(3, 6, 4, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    shared(x).sum().backward()
    ref(x2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    with pytest.raises(TypeError, match="slimgrad.nn.GroupNorm.from_torch"):
        GroupNorm.from_torch(torch.nn.LayerNorm(3))
