"""A BatchNorm subclass without its own forward is converted like BatchNorm2d, so the in-place
guard treats it as a source too (NOTE [A source by capability]): ``b.add_`` after the ReLU read
the BatchNorm output trains as eager (it raised before)."""

import torch
from torch import nn

import slimgrad


class _MyBN(nn.BatchNorm2d):
    pass


class _K(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.bn = _MyBN(8)
        self.relu = nn.ReLU()
        self.post = nn.Conv2d(8, 8, 1)

    def forward(self, x):
        b = self.bn(self.conv(x))
        y = self.post(self.relu(b))
        b.add_(1.0)
        return y


def _grads(m, x):
    x = x.clone().requires_grad_()
    m(x).pow(2).sum().backward()
    return [x.grad] + [p.grad for p in m.parameters()]


def test_bn_subclass_written_after_relu_trains_as_eager():
    torch.manual_seed(0)
    e = _K()
    torch.manual_seed(0)
    s = _K()
    slimgrad.convert_(s)
    x = torch.randn(2, 8, 6, 6)
    for a, b in zip(_grads(e, x), _grads(s, x)):
        torch.testing.assert_close(b, a)
