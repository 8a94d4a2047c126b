"""GPT-2 ln_f + tied LM head + cross-entropy, V=50257, 4x256 tokens: fused and chunked vs eager.

V = 50257, d = 768, 4 x 256 tokens (``--small``: V = 5003, d = 64, 2 x 64). Eager:
``F.cross_entropy(lm_head(ln_f(x)))``. slimgrad: ``linear_cross_entropy(ln_f(x), lm_head.weight)``
with the same Parameters. The last position of each row has target -100 (HF's shifted labels).
The record's ``grad_buffer_reuses`` counts the gradient buffers the slimgrad step reused; the
same run with ``--no-reuse`` gives the figures with reuse off. HF GPT-2 end to end:
``slimgrad bench hf_gpt2``.

Run: ``slimgrad bench linear_cross_entropy [--small] [--repeat N] [--no-reuse]`` (appends to
``benchmarks/results/linear_cross_entropy.jsonl``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slimgrad.ops.linear_cross_entropy import linear_cross_entropy

FULL = dict(vocab=50257, hidden=768, shape=(4, 256))
SMALL = dict(vocab=5003, hidden=64, shape=(2, 64))


class _EagerHead(nn.Module):
    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x, target):
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


class _SlimHead(nn.Module):
    def __init__(self, eager: _EagerHead) -> None:
        super().__init__()
        self.ln_f = eager.ln_f  # shared Parameters
        self.lm_head = eager.lm_head

    def forward(self, x, target):
        return linear_cross_entropy(self.ln_f(x), self.lm_head.weight, target)


def build(device="cpu", dtype=torch.float32, small: bool = False):
    """Returns (eager_model, slim_model, make_inputs); ``make_inputs() -> (x, target)``."""
    cfg = SMALL if small else FULL
    device = torch.device(device)
    torch.manual_seed(0)
    eager = _EagerHead(cfg["vocab"], cfg["hidden"]).to(device=device, dtype=dtype)
    with torch.no_grad():
        eager.lm_head.weight.normal_(0.0, 0.02)  # GPT-2's init
    slim = _SlimHead(eager)

    def make_inputs():
        g = torch.Generator(device="cpu").manual_seed(1)
        x = torch.randn(*cfg["shape"], cfg["hidden"], generator=g).to(device=device, dtype=dtype)
        target = torch.randint(0, cfg["vocab"], cfg["shape"], generator=g)
        target[:, -1] = -100  # HF's shifted labels: the last position predicts nothing
        return x, target.to(device)

    return eager, slim, make_inputs


def _grads(model, x, target):
    # [loss, *every Parameter's gradient] of one step (tests/ops/test_linear_cross_entropy.py).
    model.zero_grad(set_to_none=True)
    loss = model(x, target)
    loss.backward()
    out = [loss.detach()] + [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out
