"""Second derivatives through converted dropouts (nn.Dropout, timm's DropPath, attention-probs
dropout) equal eager's or raise, never silently zero (NOTE [Dropout's double backward] in
slimgrad/ops/dropout.py; review26b item 6)."""

import copy

import pytest
import torch

import slimgrad
from tests.conformance._timm_shim import timm


def _double(m, x0, seed=3):
    x = x0.clone().requires_grad_()
    torch.manual_seed(seed)
    y = m(x * 1)
    (gx,) = torch.autograd.grad((y**3).sum(), x, create_graph=True)
    assert gx.requires_grad, "first derivative without history under create_graph=True"
    (g2,) = torch.autograd.grad(gx.square().sum(), x)
    return gx.detach(), g2


def _same(mk, x0):
    torch.manual_seed(0)
    e = mk()
    c = copy.deepcopy(e)
    slimgrad.convert_(c)
    assert any(type(a) is not type(b) for a, b in zip(e.modules(), c.modules(), strict=True))
    f_e, s_e = _double(e, x0)
    f_c, s_c = _double(c, x0)
    assert torch.equal(f_c, f_e)
    assert s_e.abs().max() > 0
    torch.testing.assert_close(s_c, s_e, rtol=0, atol=0)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("shape", [(64, 16), (7, 13)])
def test_dropout_double_backward_is_eager(shape, inplace):
    x0 = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    _same(
        lambda: torch.nn.Sequential(
            torch.nn.Linear(shape[1], shape[1]), torch.nn.Dropout(0.1, inplace=inplace)
        ),
        x0,
    )


def test_drop_path_double_backward_is_eager():
    if timm is None:
        pytest.skip("timm not installed")
    x0 = torch.randn(8, 5, 16, generator=torch.Generator().manual_seed(1))
    _same(lambda: torch.nn.Sequential(torch.nn.Linear(16, 16), timm.layers.DropPath(0.3)), x0)


def test_attention_dropout_double_backward_is_eager_or_refused():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_layer=1,
        n_embd=16,
        n_head=2,
        n_positions=32,
        attn_pdrop=0.2,
        resid_pdrop=0.1,
        embd_pdrop=0.0,
        attn_implementation="eager",
    )

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = transformers.GPT2Model(cfg)

        def forward(self, x):
            return self.m(inputs_embeds=x).last_hidden_state

    x0 = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    e = Net()
    c = copy.deepcopy(e)
    slimgrad.convert_(c)
    f_e, s_e = _double(e, x0)
    try:
        f_c, s_c = _double(c, x0)
    except RuntimeError as ex:
        assert str(ex).startswith("slimgrad."), ex
        assert "second derivative" in str(ex), ex
        return
    torch.testing.assert_close(f_c, f_e)
    torch.testing.assert_close(s_c, s_e, rtol=1e-4, atol=1e-5 * s_e.abs().max().item())
