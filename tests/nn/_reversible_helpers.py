"""Builders and an independent plain reference for the reversible-block tests."""

from __future__ import annotations

import copy

import torch
from torch import nn

from slimgrad.nn.reversible import AdditiveCoupling, AffineCoupling, ReversibleSequential


def conv_fn(c_in: int, c_out: int, *, dropout: float = 0.0, bn: bool = False) -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(c_in, c_out, 3, padding=1)]
    if bn:
        layers.append(nn.BatchNorm2d(c_out))
    layers.append(nn.ReLU())
    if dropout:
        layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers)


def additive_blocks(n: int, c: int, seed: int = 0, scale: float = 1.0, **kw) -> list[nn.Module]:
    # c channels split into ceil(c/2) and floor(c/2): F maps c2 -> c1, G maps c1 -> c2.
    torch.manual_seed(seed)
    c1, c2 = (c + 1) // 2, c // 2
    blocks = [AdditiveCoupling(conv_fn(c2, c1, **kw), conv_fn(c1, c2, **kw)) for _ in range(n)]
    if scale != 1.0:
        with torch.no_grad():
            for b in blocks:
                for p in b.parameters():
                    p.mul_(scale)
    return blocks


def affine_blocks(n: int, c: int, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    c1, c2 = (c + 1) // 2, c // 2
    return [
        AffineCoupling(nn.Conv2d(c2, 2 * c1, 3, padding=1), nn.Conv2d(c1, 2 * c2, 3, padding=1))
        for _ in range(n)
    ]


class ScaleShift(nn.Module):
    """A non-coupling invertible block: y = x * exp(a) + b (per channel), with inverse()."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(c, 1, 1) * 0.1)
        self.b = nn.Parameter(torch.randn(c, 1, 1) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.a.exp() + self.b

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        return (y - self.b) / self.a.exp()


def pair(blocks: list[nn.Module], dtype=torch.float64, device="cpu", **kw):
    """(reversible chain, plain nn.Sequential of deep copies of the same blocks)."""
    blocks = [b.to(device, dtype) for b in blocks]
    plain = nn.Sequential(*copy.deepcopy(blocks))
    return ReversibleSequential(*blocks, **kw), plain


def grads(model: nn.Module, x: torch.Tensor, loss_fn, **kw) -> list[torch.Tensor]:
    """Output and gradients of loss_fn(model(x)) w.r.t. x and every parameter (autograd.grad)."""
    y = model(x)
    g = torch.autograd.grad(loss_fn(y), [x, *model.parameters()], **kw)
    return [y.detach(), *g]


def quantised_reference(blocks: list[nn.Module], x: torch.Tensor, bits: int) -> torch.Tensor:
    """Plain autograd of the exact-mode network, written independently of slimgrad's code: the
    stream's values on the grid 2^-bits held exactly in float64 (no grad); F/G run in x's dtype
    on the stream value rounded to it; their outputs rounded onto the grid; gradients
    straight-through, in x's dtype (the stream's gradient never passes through float64)."""
    s = float(2**bits)

    def q(t: torch.Tensor) -> torch.Tensor:
        return torch.round(t.detach().to(torch.float64) * s) / s

    def image(v: torch.Tensor, *through: torch.Tensor) -> torch.Tensor:
        # value v rounded to x's dtype; the gradient reaches each of ``through`` unchanged
        out = v.to(x.dtype)
        for t in through:
            out = out + (t - t.detach())
        return out

    v = q(x)
    h = image(v, x)
    for blk in blocks:
        c1 = (h.shape[1] + 1) // 2
        va, vb, ha, hb = v[:, :c1], v[:, c1:], h[:, :c1], h[:, c1:]
        f = blk.F(hb)
        va = va + q(f)
        ha = image(va, ha, f)
        g = blk.G(ha)
        vb = vb + q(g)
        hb = image(vb, hb, g)
        v, h = torch.cat([va, vb], dim=1), torch.cat([ha, hb], dim=1)
    return h


class QuantisedPlain(nn.Module):
    def __init__(self, blocks: list[nn.Module], bits: int = 20) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.bits = bits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quantised_reference(list(self.blocks), x, self.bits)
