import pytest
import torch
import torch.nn.functional as F

from slimgrad.nn.softmax_dropout import SoftmaxDropoutMatmul


def test_module_follows_training_flag():
    m = SoftmaxDropoutMatmul(0.25)
    assert isinstance(m.p, float) and "p=0.25" in repr(m)
    s, v = torch.randn(2, 5, 5), torch.randn(2, 5, 3)
    torch.manual_seed(1)
    y = m(s, v)
    torch.manual_seed(1)
    torch.testing.assert_close(y, F.dropout(F.softmax(s, -1), 0.25) @ v, rtol=0, atol=0)
    m.eval()
    torch.testing.assert_close(m(s, v), F.softmax(s, -1) @ v)
    with pytest.raises(ValueError, match="slimgrad.nn.SoftmaxDropoutMatmul"):
        SoftmaxDropoutMatmul(-0.5)


def test_causal_module_matches_functional_and_validates():
    from slimgrad.ops.softmax_dropout import softmax_dropout_matmul

    s, v = torch.randn(2, 3, 6, 6), torch.randn(2, 3, 6, 4)
    m = SoftmaxDropoutMatmul(0.2, causal=True)
    assert "causal=True" in repr(m)
    torch.manual_seed(1)
    a = m(s, v)
    torch.manual_seed(1)
    assert torch.equal(a, softmax_dropout_matmul(s, v, 0.2, causal=True))
    with pytest.raises(ValueError, match="SoftmaxDropoutMatmul: causal masks the last two dims"):
        SoftmaxDropoutMatmul(0.1, dim=1, causal=True)
