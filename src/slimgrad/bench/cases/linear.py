"""HF GPT-2 Conv1D (c_fc, 768->3072) on 4x256x768 with a frozen weight."""

from __future__ import annotations

import torch

from slimgrad.nn.linear import Conv1D


def build(device, dtype, small: bool = False):
    """Eager (``transformers`` Conv1D) and slimgrad Conv1D sharing a frozen weight; input maker."""
    from transformers.pytorch_utils import Conv1D as HFConv1D

    b, t, c = (2, 5, 12) if small else (4, 256, 768)
    eager = HFConv1D(4 * c, c).to(device=device, dtype=dtype)
    eager.weight.requires_grad_(False)
    slim = Conv1D.from_torch(eager)

    def make_inputs():
        return torch.randn(b, t, c, device=device, dtype=dtype, requires_grad=True)

    return eager, slim, make_inputs
