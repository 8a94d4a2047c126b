import importlib

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


@pytest.mark.parametrize("variant", ["llama", "gemma"])
def test_hf_fallback_channels_follow_the_weights_between_calls(variant):
    # HFRMSNorm's straight path keeps no index table when no channel of its scale gamma(w) is a
    # fallback channel (llama: w, gemma: 1 + w), and finds them again after each in-place write
    # (version) and a .data swap: gradients stay HF's (finite) when a scale becomes 0
    from slimgrad.nn.rms_norm import HFRMSNorm
    from slimgrad.ops.rms_norm import HF_VARIANTS

    torch.manual_seed(0)
    m = HFRMSNorm(6, eps=1e-6, variant=variant, eps_attr="eps")
    x = torch.randn(4, 6)
    zero = -1.0 if variant == "gemma" else 0.0  # the weight value whose scale is 0

    def grads(fn, w):
        xi = x.clone().requires_grad_()
        w.grad = None
        fn(xi * 1, w).backward(torch.arange(24.0).reshape(4, 6))
        return xi.grad, w.grad

    def check():
        ref_w = m.weight.detach().clone().requires_grad_()
        got = grads(lambda t, w: m(t), m.weight)
        want = grads(lambda t, w: HF_VARIANTS[variant][0](t, w, 1e-6)[0], ref_w)
        for a, e in zip(got, want, strict=True):
            assert torch.isfinite(a).all()
            torch.testing.assert_close(a, e)

    with torch.no_grad():
        m.weight.fill_(0.5)
    check()
    with pytest.MonkeyPatch.context() as mp:  # the Python Function's saved set (the C++ node,
        # NOTE [The RMSNorm node in C++], is taken only where no channel falls back)
        mp.setattr(importlib.import_module("slimgrad.ops.rms_norm"), "_EXT_NODE", None)
        y = m(x.detach().requires_grad_())
    assert len(y.grad_fn.saved_tensors) == 5 and y.grad_fn.saved_tensors[2] is None
    with torch.no_grad():
        m.weight[2] = zero  # a version bump
    check()
    with torch.no_grad():
        m.weight.fill_(0.5)
    check()
    w = torch.full((6,), 0.5)
    w[4] = zero
    m.weight.data = w  # no version bump
    check()
