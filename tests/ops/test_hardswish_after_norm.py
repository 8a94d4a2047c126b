"""BatchNorm -> Hardswish -> conv keeps the BatchNorm output only ("hardswish" in ops/_derived.py,
slimgrad.nn.hardswish.HardswishAfterNorm), exact against eager and float64."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.convert_handlers.cnn import convert_cnn_
from slimgrad.memory import measure
from slimgrad.nn.hardswish import HardswishAfterNorm
from slimgrad.ops import _derived
from slimgrad.testing import assert_within_rule


def _stack(act, c=6):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, c, 3), nn.BatchNorm2d(c), act, nn.Conv2d(c, 4, 3, padding=1))
    nn.init.uniform_(m[1].weight, 0.5, 1.5)
    nn.init.uniform_(m[1].bias, -0.2, 0.2)
    return m


def _run(model, x):
    x = x.detach().clone().requires_grad_()
    out = model(x)
    model.zero_grad(set_to_none=True)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)).sum().backward()
    return out.detach(), [p.grad for p in model.parameters()] + [x.grad]


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("hw", [(9, 7), (16, 13)])
def test_within_rule_of_float64_and_output_is_eagers(inplace, layout, hw):
    eager = _stack(nn.Hardswish(inplace=inplace))
    slim = convert_cnn_(copy.deepcopy(eager))
    assert type(slim[2]) is HardswishAfterNorm
    ref = copy.deepcopy(eager).double()
    x = torch.randn(3, 3, *hw)
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
        for m in (eager, slim, ref):
            m.to(memory_format=torch.channels_last)
    ye, ge = _run(eager, x)
    ys, gs = _run(slim, x)
    yr, gr = _run(ref, x.double())
    torch.testing.assert_close(ys, ye, rtol=0, atol=0)
    assert_within_rule(gs, gr, ge)


def test_derived_gradient_is_eagers_kernel_bit_for_bit():
    # the activation's own backward on the kept BN output: hardswish_backward(g, b), eager's
    b = torch.randn(4, 5, 3, 3) * 4
    b.view(-1)[:6] = torch.tensor([-3.0, 3.0, -1.5, 0.0, -2.9999998, 2.9999998])
    g = torch.randn(b.shape)
    got = _derived._act_backward("hardswish", g, b)
    x = b.clone().requires_grad_()
    torch.nn.functional.hardswish(x).backward(g)
    torch.testing.assert_close(got, x.grad, rtol=0, atol=0)
    torch.testing.assert_close(_derived.apply_act("hardswish", b), torch.nn.functional.hardswish(b))


@pytest.mark.parametrize("inplace", [False, True])
def test_keeps_one_tensor_like_bn_relu(inplace):
    # exactly the bytes of BatchNorm -> ReLU -> conv, converted: the BN output only
    x = torch.randn(4, 3, 12, 10)
    hs = convert_cnn_(_stack(nn.Hardswish(inplace=inplace)))
    relu = convert_cnn_(_stack(nn.ReLU(inplace=inplace)))
    eager = _stack(nn.Hardswish(inplace=inplace))

    def step(m):
        return lambda: m(x).square().sum()

    mh, mr, me = measure(step(hs)), measure(step(relu)), measure(step(eager))
    assert mh.saved_bytes == mr.saved_bytes
    assert mh.saved_bytes < me.saved_bytes
    assert mh.peak_bytes < me.peak_bytes


def test_without_a_norm_it_is_eagers_hardswish():
    # eager's op (keeps x): an in-place write after it cannot break its backward
    act = HardswishAfterNorm.from_torch(nn.Hardswish())
    x = torch.randn(3, 8, requires_grad=True)
    y = act(x * 1)
    assert type(y.grad_fn).__name__ == "HardswishBackward0"
    y.add_(1)
    y.sum().backward()
    with pytest.raises(TypeError, match="slimgrad.nn.HardswishAfterNorm.from_torch"):
        HardswishAfterNorm.from_torch(nn.ReLU())


def test_inplace_with_a_hook_takes_the_inplace_path():
    # a hook can see the BN output: no proof of ownership, so it is written in place, as eager
    eager = _stack(nn.Hardswish(inplace=True))
    slim = convert_cnn_(copy.deepcopy(eager))
    seen = []
    slim[1].register_forward_hook(lambda m, i, o: seen.append(o))
    x = torch.randn(2, 3, 8, 8)
    y = slim(x)
    assert seen[0] is not None and _derived.lookup(seen[0]) is None
    torch.testing.assert_close(seen[0], torch.nn.functional.hardswish(slim[1](slim[0](x))))
    torch.testing.assert_close(y, eager(x), rtol=0, atol=0)


def test_convert_swaps_hardswish_after_batch_norm_only():
    model = nn.Sequential(_stack(nn.Hardswish()), nn.Flatten(), nn.Hardswish())
    slimgrad.convert_(model)
    assert type(model[0][2]) is HardswishAfterNorm
    assert type(model[2]).__name__ == "Hardswish" and type(model[2]) is not nn.Hardswish
