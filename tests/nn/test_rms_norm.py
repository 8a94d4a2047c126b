import pytest
import torch

from slimgrad.nn.rms_norm import RMSNorm


@pytest.mark.parametrize("kw", [{}, {"elementwise_affine": False}, {"eps": 1e-3}])
def test_same_args_state_dict_and_values(kw):
    ref = torch.nn.RMSNorm(7, **kw)
    ours = RMSNorm(7, **kw)
    assert list(ours.state_dict()) == list(ref.state_dict())
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(5, 7, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, y2 = ours(x), ref(x2)
    torch.testing.assert_close(y, y2)
    y.sum().backward()
    y2.sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)


def test_from_torch_shares_parameters():
    ref = torch.nn.RMSNorm(6, eps=1e-4)
    ours = RMSNorm.from_torch(ref)
    assert ours.weight is ref.weight and ours.eps == 1e-4
    with pytest.raises(TypeError, match="slimgrad.nn.RMSNorm.from_torch"):
        RMSNorm.from_torch(torch.nn.LayerNorm(6))


@pytest.mark.parametrize("variant", ["llama", "gemma", "t5", "unweighted"])
def test_hf_rms_norm_constructor_and_values(variant):
    from slimgrad.nn.rms_norm import HFRMSNorm
    from slimgrad.ops.rms_norm import HF_VARIANTS

    eps_attr = "eps" if variant in ("gemma", "unweighted") else "variance_epsilon"
    m = HFRMSNorm(8, eps=1e-5, variant=variant, eps_attr=eps_attr)
    assert getattr(m, eps_attr) == 1e-5
    assert ("weight" in m.state_dict()) == (variant != "unweighted")
    x = torch.randn(3, 8).to(torch.bfloat16)
    w = m.weight if variant != "unweighted" else None
    torch.testing.assert_close(m(x), HF_VARIANTS[variant][0](x, w, 1e-5)[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match="slimgrad.nn.HFRMSNorm: unknown variant"):
        HFRMSNorm(8, variant="nope")
