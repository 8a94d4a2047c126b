"""ELU on tiny shapes keeps and peaks at no more than eager (issue 30, class 7).

A tensor of at most ``DENSE_MAX`` elements keeps x, as eager (NOTE [Few elements] in
``slimgrad.ops._output_act``): before, alpha < 0 kept y + a byte of bits (5 B against eager's 4 B
for one element) and peaked at 34,829 B on the first call (the bit-unpacking table) and 33 B after
(eager: 20 B, the measured step's clone and product included); alpha > 0 peaked above eager too (the
meta tensors of the layout query: 124 B against 92 B at 7 elements).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from slimgrad._math import bits as _bits
from slimgrad.memory import measure
from slimgrad.ops.elu import elu

SHAPES = list(itertools.product((1, 2), (1, 3, 8), (1, 2, 4)))


@pytest.mark.parametrize("alpha", [-0.5, 1.0, 0.3, -2.0])
def test_tiny_shapes_never_above_eager(alpha):
    for b, c, s in SHAPES:
        x0 = torch.randn(b, c, s, s, generator=torch.Generator().manual_seed(b * 100 + c * 10 + s))
        x0.view(-1)[0] = -3.0  # one element in NOTE [ELU's tail]
        _bits._SPREAD.clear()  # a first call: no cached unpacking table
        ms = measure(
            lambda x0=x0: elu(x0.clone().requires_grad_() * 1, alpha).sum(), timeline=False
        )
        me = measure(
            lambda x0=x0: F.elu(x0.clone().requires_grad_() * 1, alpha).sum(), timeline=False
        )
        where = f"alpha {alpha} shape {(b, c, s, s)}"
        assert ms.saved_bytes <= me.saved_bytes, where
        assert ms.peak_bytes <= me.peak_bytes, where
        g = torch.randn(x0.shape)
        xa, xb = x0.clone().requires_grad_(), x0.clone().requires_grad_()
        (da,) = torch.autograd.grad(elu(xa, alpha), xa, g)
        (db,) = torch.autograd.grad(F.elu(xb, alpha), xb, g)
        torch.testing.assert_close(da, db, rtol=0, atol=0)
