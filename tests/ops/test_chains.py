"""Property test: random chains of this area's ops give eager's values and every gradient."""

import types

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from slimgrad.ops.dropout import dropout
from slimgrad.ops.layer_norm import layer_norm
from slimgrad.ops.linear import linear
from slimgrad.ops.matmul import matmul
from slimgrad.ops.rms_norm import rms_norm
from slimgrad.ops.softmax_dropout import softmax_dropout_matmul

D = 6


def _step(kind, h, params, slim):
    w, b, mat = params
    if kind == "ln":
        return (layer_norm if slim else F.layer_norm)(h, (D,), w, b)
    if kind == "rms":
        return (rms_norm if slim else F.rms_norm)(h, (D,), w)
    if kind == "drop":
        return (dropout if slim else F.dropout)(h, 0.3)
    if kind == "linear":
        return (linear if slim else F.linear)(h, mat, b)
    if kind == "matmul":
        return (matmul if slim else torch.matmul)(h, mat)
    if kind == "sdm":
        if slim:
            return softmax_dropout_matmul(h, mat, 0.2)
        return F.dropout(F.softmax(h, -1), 0.2) @ mat
    return h.tanh()


@settings(max_examples=25, deadline=None)
@given(
    kinds=st.lists(
        st.sampled_from(["ln", "rms", "drop", "linear", "matmul", "sdm", "tanh"]),
        min_size=1,
        max_size=5,
    ),
    rows=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_random_chains_match_eager(kinds, rows, seed):
    gen = torch.Generator().manual_seed(seed)
    x0 = torch.randn(rows, D, generator=gen, dtype=torch.float64)
    raw = [torch.randn(D, D, generator=gen, dtype=torch.float64) for _ in kinds]
    params0 = [(1 + 0.3 * m[0], 0.3 * m[1], m / D**0.5) for m in raw]
    results = []
    for slim in (True, False):
        x = x0.clone().requires_grad_()
        params = [tuple(t.clone().requires_grad_() for t in p) for p in params0]
        torch.manual_seed(seed)
        h = x
        for kind, p in zip(kinds, params):
            h = _step(kind, h, p, slim)
        h.backward(torch.ones_like(h))
        leaves = [x] + [t for p in params for t in p]
        results.append([h.detach()] + [t.grad for t in leaves])
    for o, e in zip(*results):
        assert (o is None) == (e is None)
        if o is not None:
            torch.testing.assert_close(o, e)


@pytest.mark.parametrize("act", ["relu", "gelu", "silu", "elu", "leaky_relu"])
def test_derived_activation_double_backward_is_eagers(act):
    # NOTE [Derived saved inputs]: the derived act keeps b, so create_graph recomputes eager's act
    import importlib

    derived = importlib.import_module("slimgrad.ops._derived")

    class _Source:
        pack = None  # a source's one pack under saved-tensor hooks (none here: no hooks)
        # the call's ctx: derived records are chained on it (NOTE [Dropped at b's backward])
        ctx = types.SimpleNamespace(derived=None)

        def keep_output(self, b):
            return True

    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    b = x * 2
    derived.register_source(b, _Source())
    r = derived.activation(b, act, param=0.3)
    assert type(r.grad_fn).__name__ == "_DerivedActFnBackward"
    (g,) = torch.autograd.grad(r.square().sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), x)
    spec = (act, 0.3, False) if act in ("elu", "leaky_relu") else act
    xe = x.detach().clone().requires_grad_()
    (ge,) = torch.autograd.grad(
        derived.apply_act(spec, xe * 2).square().sum(), xe, create_graph=True
    )
    (gge,) = torch.autograd.grad(ge.sum(), xe)
    torch.testing.assert_close(g, ge)
    torch.testing.assert_close(gg, gge)
