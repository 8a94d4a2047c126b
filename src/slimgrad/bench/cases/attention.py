"""GPT-2 attention block, dropout 0.1: LN, qkv Linear, causal softmax, dropout, @V, proj."""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from slimgrad.nn.dropout import Dropout
from slimgrad.nn.layer_norm import LayerNorm
from slimgrad.nn.linear import Linear
from slimgrad.nn.softmax_dropout import SoftmaxDropoutMatmul

__all__ = ["EagerAttentionBlock", "SlimAttentionBlock", "build"]


class EagerAttentionBlock(nn.Module):
    """``x + drop(proj(drop(softmax(q k^T / sqrt(d) + causal)) @ v))`` with q, k, v from LN(x)."""

    def __init__(self, d_model: int, n_head: int, max_len: int, p: float = 0.1) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.attn_drop = nn.Dropout(p)
        self.resid_drop = nn.Dropout(p)
        future = torch.ones(max_len, max_len, dtype=torch.bool).triu(1)  # positions to mask out
        self.register_buffer("future", future, persistent=False)

    def _qkv(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.shape[-1]))
        return att.masked_fill(self.future[:t, :t], float("-inf")), v

    def _out(self, x, y):
        b, t, c = x.shape
        return x + self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        att, v = self._qkv(x)
        y = self.attn_drop(torch.softmax(att, dim=-1)) @ v
        return self._out(x, y)


class SlimAttentionBlock(EagerAttentionBlock):
    """The same block with slimgrad's LayerNorm, Linear, softmax->dropout->@V and Dropout."""

    @classmethod
    def from_eager(cls, eager: EagerAttentionBlock) -> SlimAttentionBlock:
        new = copy.copy(eager)
        new.__class__ = cls
        new._modules = dict(eager._modules)
        new.ln = LayerNorm.from_torch(eager.ln)
        new.qkv = Linear.from_torch(eager.qkv)
        new.proj = Linear.from_torch(eager.proj)
        new.attn_drop = SoftmaxDropoutMatmul(eager.attn_drop.p, causal=True)
        new.resid_drop = Dropout.from_torch(eager.resid_drop)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the causal mask inside the op (no masked copy of the scores kept for backward)
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.shape[-1]))
        return self._out(x, self.attn_drop(att, v))


def build(device, dtype, small: bool = False):
    """Eager and slimgrad GPT-2 attention blocks (same weights) and an input maker."""
    b, t, c, h = (2, 7, 12, 3) if small else (4, 256, 768, 12)
    eager = EagerAttentionBlock(c, h, t).to(device=device, dtype=dtype)
    slim = SlimAttentionBlock.from_eager(copy.deepcopy(eager))

    def make_inputs():
        return torch.randn(b, t, c, device=device, dtype=dtype, requires_grad=True)

    return eager, slim, make_inputs
