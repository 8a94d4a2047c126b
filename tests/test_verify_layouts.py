"""verify compares gradients, outputs and buffers of every layout and dtype it meets.

NOTE [Comparing every layout] (src/slimgrad/verify.py): sparse tensors as the dense tensors they
stand for (coalesced, on the union of their indices), complex ones by the modulus of the
difference; anything else fails with a "not compared" line.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import slimgrad
from tests._verify_helpers import scale_grad


class _Bag(nn.Module):
    def __init__(self, sparse: bool = True, mode: str = "mean"):
        super().__init__()
        self.emb = nn.Embedding(11, 5, sparse=sparse)
        self.bag = nn.EmbeddingBag(13, 5, mode=mode, sparse=sparse)
        self.head = nn.Linear(5, 3)

    def forward(self, ids, bag_ids):
        return self.head(self.emb(ids).mean(1) + self.bag(bag_ids))


def _inputs():
    torch.manual_seed(3)
    # repeated ids: each sparse gradient is uncoalesced (one row per occurrence)
    return torch.randint(0, 4, (4, 7)), torch.randint(0, 5, (4, 6))


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_sparse_embedding_gradients_are_compared(mode):
    torch.manual_seed(0)
    m = _Bag(mode=mode)
    rep = slimgrad.verify(m, copy.deepcopy(m), _inputs())
    assert rep.ok, str(rep)
    names = {g.name for g in rep.grads}
    assert {"emb.weight", "bag.weight"} <= names
    assert all(0 <= g.err < 1e-5 for g in rep.grads)


class _WrongRow(torch.autograd.Function):
    # a sparse embedding backward that puts the last occurrence's gradient on the next row
    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.rows = weight.shape[0]
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, g):
        (ids,) = ctx.saved_tensors
        idx = ids.reshape(1, -1).clone()
        idx[0, -1] = (idx[0, -1] + 1) % ctx.rows
        vals = g.reshape(-1, g.shape[-1])
        size = (ctx.rows, g.shape[-1])
        return None, torch.sparse_coo_tensor(idx, vals, size, check_invariants=True)


class _ScaledEmbedding(nn.Embedding):
    def forward(self, ids):
        return F.embedding(ids, scale_grad(self.weight, 1.001), sparse=True)


class _WrongRowEmbedding(nn.Embedding):
    def forward(self, ids):
        return _WrongRow.apply(ids, self.weight)


@pytest.mark.parametrize("wrong", [_ScaledEmbedding, _WrongRowEmbedding])
def test_a_wrong_sparse_gradient_fails(wrong):
    torch.manual_seed(0)
    m = _Bag()
    bad = copy.deepcopy(m)
    bad.emb = wrong(11, 5, sparse=True)
    bad.emb.load_state_dict(m.emb.state_dict())
    rep = slimgrad.verify(m, bad, _inputs(), modes=("train",))
    assert not rep.ok
    assert [g.name for g in rep.grads if not g.ok] == ["emb.weight"], str(rep)
    # the converted gradient is still sparse: the failure is the values, not the layout
    assert "wrong layout" not in str(rep)


def test_a_dense_gradient_where_eager_gives_a_sparse_one_fails():
    torch.manual_seed(0)
    m = _Bag()
    dense = copy.deepcopy(m)
    dense.emb.sparse = False  # same values, a dense gradient: SparseAdam would refuse it
    rep = slimgrad.verify(m, dense, _inputs(), modes=("train",))
    assert not rep.ok
    assert "the gradient of 'emb.weight' has the wrong layout; expected torch.sparse_coo" in str(
        rep
    )
    bad = [g for g in rep.grads if not g.ok]
    assert [g.name for g in bad] == ["emb.weight"] and bad[0].err < 1e-6


class _SpMM(nn.Module):
    """A sparse weight (COO or CSR) through torch.sparse.mm: its gradient has its layout."""

    def __init__(self, layout, grad_scale=1.0):
        super().__init__()
        torch.manual_seed(0)
        d = torch.randn(6, 5)
        d[d.abs() < 0.6] = 0
        self.w = nn.Parameter(d.to_sparse(layout=layout))
        self.lin = nn.Linear(4, 3)
        self.grad_scale = grad_scale

    def forward(self, x):
        w = self.w if self.grad_scale == 1.0 else scale_grad(self.w, self.grad_scale)
        return self.lin(torch.sparse.mm(w, x))


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr])
def test_sparse_parameters_and_their_gradients(layout):
    x = torch.randn(5, 4)
    rep = slimgrad.verify(_SpMM(layout), _SpMM(layout), x)
    assert rep.ok, str(rep)
    assert rep.grads[0].name == "w" and rep.grads[0].err < 1e-6
    rep = slimgrad.verify(_SpMM(layout), _SpMM(layout, grad_scale=1.001), x, modes=("train",))
    assert [g.name for g in rep.grads if not g.ok] == ["w"], str(rep)


class _SparseOut(nn.Module):
    def __init__(self, shift=0.0):
        super().__init__()
        self.lin, self.shift = nn.Linear(4, 6), shift

    def forward(self, x):
        y = F.relu(self.lin(x) - 0.3)
        return y, (y + self.shift * (y != 0)).to_sparse()


def test_sparse_outputs_are_compared():
    torch.manual_seed(0)
    m = _SparseOut()
    x = torch.randn(5, 4)
    loss = lambda out: out[0].sum()  # noqa: E731
    assert slimgrad.verify(m, copy.deepcopy(m), x, loss_fn=loss).ok
    bad = _SparseOut(shift=1e-3)
    bad.load_state_dict(m.state_dict())
    rep = slimgrad.verify(m, bad, x, loss_fn=loss, modes=("train",))
    assert [o.name for o in rep.runs[0].outputs if not o.ok] == ["[1]"], str(rep)


class _Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        y = self.lin(x)
        return y, torch.nested.nested_tensor([y[0], y[1, :2]], layout=torch.jagged)


def test_an_output_verify_cannot_compare_fails_with_a_not_compared_line():
    torch.manual_seed(0)
    m = _Nested()
    rep = slimgrad.verify(m, copy.deepcopy(m), torch.randn(5, 4), loss_fn=lambda o: o[0].sum())
    assert not rep.ok
    assert "slimgrad.verify: output '[1]' was not compared; expected a strided or sparse" in (
        str(rep)
    )
    assert "got layout nested" in str(rep)


class _ComplexNet(nn.Module):
    """A complex weight; ``imag_scale`` scales only the imaginary part of its gradient."""

    def __init__(self, imag_scale=1.0):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 3, dtype=torch.complex64))
        self.lin = nn.Linear(3, 2)
        self.imag_scale = imag_scale

    def forward(self, x):
        w = self.w if self.imag_scale == 1.0 else _ImagGrad.apply(self.w, self.imag_scale)
        z = x.to(w.dtype) @ w
        return self.lin(z.abs() + z.angle())


class _ImagGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, scale):
        ctx.scale = scale
        return w.clone()

    @staticmethod
    def backward(ctx, g):
        return torch.complex(g.real, g.imag * ctx.scale), None


def test_complex_parameters_are_compared_in_complex128():
    x = torch.randn(5, 4)
    rep = slimgrad.verify(_ComplexNet(), _ComplexNet(), x)
    assert rep.ok, str(rep)
    assert rep.grads[0].name == "w" and rep.grads[0].err < 1e-5
    # the reference is complex128: the imaginary part is not dropped by .to(float64)
    bad = slimgrad.verify(_ComplexNet(), _ComplexNet(imag_scale=1.001), x, modes=("train",))
    assert [g.name for g in bad.grads if not g.ok] == ["w"], str(bad)


def test_complex_inputs_are_widened_for_the_reference():
    class C(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 3, dtype=torch.complex64))

        def forward(self, z):
            return (z @ self.w).abs().square().mean()

    torch.manual_seed(0)
    m = C()
    rep = slimgrad.verify(m, copy.deepcopy(m), torch.randn(5, 4, dtype=torch.complex64))
    assert rep.ok, str(rep)


def test_err_is_the_modulus_and_sparse_tensors_compare_as_dense():
    from slimgrad.verify import _err

    a = torch.tensor([1 + 1j, 0j], dtype=torch.complex128)
    torch.testing.assert_close(_err(a, torch.zeros(2, dtype=torch.complex128)), 2**0.5)
    # uncoalesced COO (duplicates sum), disjoint indices, against CSR and dense
    i = torch.tensor([[0, 0, 2], [1, 1, 0]])
    s = torch.sparse_coo_tensor(i, torch.tensor([1.0, 2.0, -4.0]), (3, 2))
    d = s.to_dense()
    for other in (d, d.to_sparse_csr(), d.to_sparse()):
        assert _err(s, other) == 0.0 and _err(other, s) == 0.0
    moved = torch.sparse_coo_tensor(torch.tensor([[1], [1]]), torch.tensor([3.0]), (3, 2))
    torch.testing.assert_close(_err(s, moved), 4.0)  # 3 at (0, 1), -4 at (2, 0), 3 at (1, 1)
    torch.testing.assert_close(_err(s, d.double() + 0.5), 0.5)


def test_a_non_finite_sparse_gradient_fails():
    class NanEmbedding(nn.Embedding):
        def forward(self, ids):
            return F.embedding(ids, scale_grad(self.weight, float("nan")), sparse=True)

    torch.manual_seed(0)
    m = _Bag()
    bad = copy.deepcopy(m)
    bad.emb = NanEmbedding(11, 5, sparse=True)
    bad.emb.load_state_dict(m.emb.state_dict())
    rep = slimgrad.verify(m, bad, _inputs(), modes=("train",))
    assert not rep.ok
    assert "the converted model has non-finite values" in str(rep)
    assert "grad emb.weight" in str(rep)
