"""A conv whose weight is frozen and whose input needs grad: never above eager's peak.

NOTE [A stand-in for x] (ops/conv.py): dx needs W only, so nothing of x is kept; the dx-only
backward still needs a tensor in x's shape and layout. Where x's storage is alive at backward (a
leaf, held by its AccumulateGrad node; a ReLU's output, held by the ReLU's node; the caller's
tensor) a view of it stands in, and under saved-tensor hooks x is kept as eager keeps it.
"""

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import slimgrad
from slimgrad.memory import measure


def _pair(make, frozen=("weight",)):
    torch.manual_seed(0)
    eager = nn.Sequential(make())
    for m in eager.modules():
        for name in frozen:
            p = getattr(m, name, None)
            if isinstance(p, nn.Parameter):
                p.requires_grad_(False)
    return eager, slimgrad.convert_(copy.deepcopy(eager))


def _step(model, a0, pre=None, ck=False, autocast=False):
    # forward of one step from a fresh leaf a (its input x = pre(a), or a itself); grads read back
    def f():
        a = a0.clone().requires_grad_()
        f.a = a
        x = a if pre is None else pre(a)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = checkpoint(model, x, use_reentrant=False) if ck else model(x)
        return y.float().sum()

    return f


def _compare(eager, slim, a0, **kw):
    fe, fs = _step(eager, a0, **kw), _step(slim, a0, **kw)
    re, rs = measure(fe, timeline=False), measure(fs, timeline=False)
    got = [fs.a.grad, *(p.grad for p in slim.parameters())]
    want = [fe.a.grad, *(p.grad for p in eager.parameters())]
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            torch.testing.assert_close(g, w, rtol=0, atol=0)
            assert g.stride() == w.stride()
    return re, rs


def _relu(a):
    return torch.relu(a * 1)  # ReluBackward0 keeps its output: x's storage outlives x


@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda: nn.Conv1d(3, 5, 3), (2, 3, 6)),
        (lambda: nn.Conv2d(3, 5, 3, bias=False), (2, 3, 6, 6)),
        (lambda: nn.Conv3d(3, 5, 3), (2, 3, 6, 6, 6)),
        (lambda: nn.Conv2d(4, 2, 3, stride=2, groups=2), (2, 4, 7, 7)),
        (lambda: nn.ConvTranspose2d(4, 2, 3, padding=1), (2, 4, 6, 6)),
    ],
)
@pytest.mark.parametrize("pre", [None, _relu], ids=["leaf", "relu_output"])
def test_frozen_weight_peak_not_above_eager(make, shape, pre):
    # leaf x: Conv2d(3, 5, 3) at (2, 3, 6, 6) peaked 2,296 B against eager's 1,432 (an empty
    # buffer of x's bytes stood in for x at backward)
    eager, slim = _pair(make)
    re, rs = _compare(eager, slim, torch.randn(shape), pre=pre)
    assert rs.saved_bytes <= re.saved_bytes
    assert rs.peak_bytes <= re.peak_bytes


def test_frozen_weight_and_bias_channels_last_dx_in_eagers_layout():
    eager, slim = _pair(lambda: nn.Conv2d(4, 6, 3, padding=1), frozen=("weight", "bias"))
    a0 = torch.randn(2, 4, 5, 7).to(memory_format=torch.channels_last)
    re, rs = _compare(eager, slim, a0)
    assert rs.peak_bytes <= re.peak_bytes


def test_frozen_weight_under_checkpoint_with_x_made_inside_the_region():
    # x = relu(a) made inside the checkpointed region: the recompute keeps a new relu(a) alive
    # until the conv's backward, and the forward's storage is gone. Keeping x through
    # save_for_backward (as eager) hands the conv that recomputed x; before, a buffer of x's bytes
    # stood in next to it (42,896 B against eager's 41,488)
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(16, 2, 3, stride=2)

        def forward(self, a):
            return self.conv(torch.relu(a * 1))

    torch.manual_seed(0)
    eager = M()
    eager.conv.weight.requires_grad_(False)
    slim = slimgrad.convert_(copy.deepcopy(eager))
    a0 = torch.randn(2, 16, 9, 9)
    for ck in (False, True):
        re, rs = _compare(eager, slim, a0, ck=ck)
        assert rs.peak_bytes <= re.peak_bytes


def test_frozen_weight_under_autocast_and_at_batch_zero():
    eager, slim = _pair(lambda: nn.Conv2d(3, 5, 3))
    re, rs = _compare(eager, slim, torch.randn(2, 3, 6, 6), autocast=True)
    assert rs.peak_bytes <= re.peak_bytes
    re, rs = _compare(eager, slim, torch.randn(0, 3, 6, 6))
    assert rs.peak_bytes <= re.peak_bytes


def test_frozen_weight_expanded_input_takes_a_buffer():
    # x = a.expand(...): its storage holds one sample, fewer bytes than x's shape needs, so it
    # cannot stand in (an empty buffer does); dx as eager's
    eager, slim = _pair(lambda: nn.Conv2d(3, 5, 3))
    re, rs = _compare(eager, slim, torch.randn(1, 3, 6, 6), pre=lambda a: a.expand(4, 3, 6, 6))
    assert rs.peak_bytes <= re.peak_bytes


@pytest.mark.parametrize("first_trainable", [False, True])
def test_frozen_backbone_conv_bn_relu(first_trainable):
    torch.manual_seed(0)
    eager = nn.Sequential(
        nn.Conv2d(4, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
    )
    for i, m in enumerate(c for c in eager if isinstance(c, nn.Conv2d)):
        m.weight.requires_grad_(first_trainable and i == 0)
    slim = slimgrad.convert_(copy.deepcopy(eager))
    a0 = torch.randn(2, 4, 6, 6)
    fe, fs = _step(eager, a0), _step(slim, a0)
    re, rs = measure(fe, timeline=False), measure(fs, timeline=False)
    assert rs.peak_bytes <= re.peak_bytes
    assert rs.saved_bytes < re.saved_bytes
    # (slimgrad's BatchNorm gradients are eager's within rounding, not bit for bit)
    got = [fs.a.grad, *(p.grad for p in slim.parameters() if p.requires_grad)]
    want = [fe.a.grad, *(p.grad for p in eager.parameters() if p.requires_grad)]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
