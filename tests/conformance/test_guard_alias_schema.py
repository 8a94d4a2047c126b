"""Conformance: the in-place guard decides which calls may return their input from the ATen schema
(NOTE [Which calls may return their input: read from the op's schema] in
slimgrad/convert_handlers/inplace_guard.py).

Before, a call not in the guard's list counted as returning a fresh tensor: a write through
torch.hsplit/vsplit/dsplit, Tensor.hsplit, torch.ravel, atleast_2d/3d, broadcast_to, adjoint, or
``v[...] = c`` through ``.T``/``.mT``/``.H``/``.real`` after a LayerNorm was missed, the norm
converted, and the converted backward raised autograd's in-place error where eager trains. Each
row writes through one spelling, in a forward torch.fx traces and in one it cannot (the source is
read), and checks the norm is kept and the gradients equal eager's; a fresh result written in place
keeps the norm converted.
"""

from __future__ import annotations

import copy
import importlib.util
import sys

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.convert_handlers.inplace_guard import _may_alias, kept_reason
from tests._threads import one_thread


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


# (name, expression of h giving v, the write on v)
_VIEWS = {
    "torch.hsplit": "torch.hsplit(h, 3)[0]",
    "Tensor.hsplit": "h.hsplit(3)[0]",
    "torch.vsplit": "torch.vsplit(h, 3)[0]",
    "torch.dsplit": "torch.dsplit(h.view(3, 3, 2), 2)[0]",
    "torch.ravel": "torch.ravel(h)",
    "Tensor.ravel": "h.ravel()",
    "torch.atleast_2d": "torch.atleast_2d(h)",
    "torch.atleast_3d": "torch.atleast_3d(h)",
    "torch.broadcast_to": "torch.broadcast_to(h, h.shape)",
    "torch.adjoint": "torch.adjoint(h)",
    "Tensor.T": "h.T",
    "Tensor.mT": "h.mT",
    "Tensor.H": "h.H",
    "Tensor.real": "h.real",
}
_WRITES = {"mul_": "v.mul_(2.0)", "setitem": "v[...] = 0.5"}
_BRANCH = "        if h.sum() > -1e30:  # data-dependent: torch.fx cannot trace this forward\n"


def _source(view: str, write: str, traced: bool) -> str:
    body = f"        v = {view}\n        {write}\n"
    if not traced:
        body = _BRANCH + "".join("    " + line + "\n" for line in body.splitlines())
    return (
        "import torch\nfrom torch import nn\n\n\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = nn.Linear(6, 6)\n"
        "        self.ln = nn.LayerNorm(6)\n"
        "        self.o = nn.Linear(6, 2)\n\n"
        "    def forward(self, x):\n"
        "        h = self.ln(self.fc(x))\n" + body + "        return self.o(h)\n"
    )


def _load(tmp_path, src: str, tag: str):
    path = tmp_path / f"guard_alias_{tag}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"guard_alias_{tag}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod.M


def _grads(m, x):
    m.zero_grad()
    m(x).square().sum().backward()
    return {k: p.grad.clone() for k, p in m.named_parameters()}


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "source"])
@pytest.mark.parametrize("write", list(_WRITES))
@pytest.mark.parametrize("view", list(_VIEWS))
def test_write_through_view_keeps_norm(tmp_path, view, write, traced):
    tag = f"{view.replace('.', '_')}_{write}_{traced}"
    cls = _load(tmp_path, _source(_VIEWS[view], _WRITES[write], traced), tag)
    torch.manual_seed(0)
    m = cls()
    x = torch.randn(3, 6)
    want = _grads(m, x)
    c = copy.deepcopy(m)
    slimgrad.convert_(c)
    assert kept_reason(c.ln) is not None, view
    got = _grads(c, x)
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "source"])
def test_write_on_fresh_result_keeps_norm_converted(tmp_path, traced):
    cls = _load(tmp_path, _source("h + 1.0", "v.mul_(2.0)", traced), f"fresh_{traced}")
    torch.manual_seed(0)
    m = cls()
    c = slimgrad.convert_(copy.deepcopy(m))
    assert kept_reason(c.ln) is None
    assert type(c.ln) is not nn.LayerNorm
    x = torch.randn(3, 6)
    want, got = _grads(m, x), _grads(c, x)
    assert all(torch.allclose(got[k], want[k], rtol=1e-5, atol=1e-6) for k in want)


def test_alias_facts_from_schema():
    # annotated returns, composite kernels whose schema states nothing, unresolvable names
    for name in ("hsplit", "ravel", "broadcast_to", "adjoint", "T", "mT", "H", "real", "view"):
        assert _may_alias(name), name
    assert _may_alias("atleast_2d") and _may_alias("type_as")  # composite: may return input
    assert _may_alias("a_user_helper_not_in_aten")
    for name in ("add", "mul", "gelu", "cat", "truediv", "clone", "exp"):
        assert not _may_alias(name), name
