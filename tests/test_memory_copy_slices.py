"""``slimgrad.memory`` counts what autograd keeps through a ``CopySlices`` node (an in-place op on
a view of a tensor that requires grad): the wrapped op's own node and its saved tensors (NOTE [How
saved bytes are counted] in slimgrad/memory.py). Before, the graph walk could not reach that node
and its tensors were missing from ``saved_bytes`` (``x[1].exp_()`` kept x, counted 0 B).

The reference: the same forward run once under ``saved_tensors_hooks`` that record every storage
autograd packs (a hook sees the wrapped nodes' saved tensors too)."""

from __future__ import annotations

import pytest
import torch

from slimgrad import _ext
from slimgrad.memory import estimate, measure

pytestmark = pytest.mark.skipif(
    not _ext.available(), reason="needs slimgrad's C++ extension (copy_slices_fn)"
)


def _exp_of_a_row(a, w, b):
    x = a * w
    x[1].exp_()  # ExpBackward0 keeps its result: x's storage
    return x.sum()


def _mul_of_a_slice_by_a_step_tensor(a, w, b):
    x = a * w
    x[:, 2:5].mul_(b[:, 2:5] * 3)  # MulBackward0 keeps the product (its other)
    return x.square().sum()


def _two_in_place_ops_on_slices(a, w, b):
    x = a * w + 1
    c = b.sigmoid()
    x[:, :4].addcmul_(c[:, :4], b[:, :4] + 1)  # keeps both factors' storages (c's and b + 1)
    x[2:].sigmoid_()  # keeps its result (x's storage)
    return x.sum()


def _masked_fill_of_a_column(a, w, b):
    x = a + w
    x[:, 1].masked_fill_(b[:, 1] > 0, 0.0)  # the mask, a step tensor of bools
    return (x * x).sum()


def _setitem_with_a_grad_value(a, w, b):
    x = a * 2
    v = (b[:3] * w).tanh()
    x[1:4] = v  # CopySlices around copy_; v's TanhBackward0 keeps v
    x[:, 0].mul_(v[0, :1])
    return x.sum()


CASES = [
    _exp_of_a_row,
    _mul_of_a_slice_by_a_step_tensor,
    _two_in_place_ops_on_slices,
    _masked_fill_of_a_column,
    _setitem_with_a_grad_value,
]


def _inputs():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(6, 8, generator=g)
    w = torch.randn(8, generator=g).requires_grad_()
    b = torch.randn(6, 8, generator=g)
    return a, w, b


def _packed(fn):
    # unique storages autograd packs in the step (not the inputs'), by hooks that keep the tensors
    a, w, b = _inputs()
    before = {t.untyped_storage().data_ptr() for t in (a, w, b)}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in before:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(a, w, b)
    del out
    return sorted(seen.values())


@pytest.mark.parametrize("fn", CASES, ids=lambda f: f.__name__.strip("_"))
def test_saved_bytes_count_what_copy_slices_keeps(fn):
    a, w, b = _inputs()
    step = measure(lambda: fn(a, w, b), timeline=False)
    got = sorted(s.nbytes for s in step.saved if s.kind == "step")
    assert got == _packed(fn)
    assert step.saved_bytes == sum(got)


@pytest.mark.parametrize("fn", CASES, ids=lambda f: f.__name__.strip("_"))
def test_the_estimate_counts_them_too(fn):
    a, w, b = _inputs()
    real = measure(lambda: fn(a, w, b), timeline=False)

    def make():
        a, w, b = _inputs()
        return lambda: fn(a, w, b)

    est = estimate(make, timeline=False)
    assert (est.saved_bytes, est.peak_bytes) == (real.saved_bytes, real.peak_bytes)
    assert est.saved_bytes == sum(_packed(fn))


def test_the_wrapped_node_is_named_and_attributed_to_the_module():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x)
            h[:, :3].exp_()
            return h

    torch.manual_seed(0)
    m = torch.nn.Sequential(Block())
    x = torch.randn(4, 8)
    step = measure(lambda: m(x).sum(), module=m, timeline=False)
    kept = [s for s in step.saved if "ExpBackward0" in s.savers]
    assert len(kept) == 1 and kept[0].nbytes == 4 * 8 * 4 and kept[0].module == "0"
