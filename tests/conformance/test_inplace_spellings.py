"""Conformance: a converted module whose output is written in place, by any spelling, trains as
eager.

Issue 30's leftover in the in-place guard (NOTE [In-place writes in HF forwards] in
``slimgrad/convert_handlers/inplace_guard.py``): the guard's source reader, which reads every
forward torch.fx cannot trace (and every HF forward), missed in-place writes spelled
``torch.ops.aten.mul_.Tensor(h, ...)``, through a module-level alias of ``torch.ops.aten``,
``getattr(h, "mul_")(...)``, ``h.__iadd__(r)`` and ``F.leaky_relu(h, 0.1, True)`` (inplace given
positionally), and it read a helper method of the module without the module: a write inside the
helper on a child's output, or in the forward on what the helper returns, went unseen. The
converted module then kept its output for backward and autograd raised "modified by an inplace
operation" where eager trains.

Rows: spellings x converted op types that keep their output where eager keeps its input
(LayerNorm, RMSNorm, GroupNorm, HF LlamaRMSNorm, GELU, SiLU, Mish, ELU, LeakyReLU, Hardswish, and
BatchNorm followed by GELU/SiLU, whose pair keeps one tensor) x a forward torch.fx traces and one it
cannot (read from its source), in train mode: every spelling and every op type both traced and read
from source, the combinations chosen to run every code path (``ROWS``). Each row runs eager and
converted side by side from the same weights and input: the same loss and gradients, bit for bit
(a module the guard keeps runs eager's op), or where the write hits something eager keeps too, the
same error.
"""

from __future__ import annotations

import copy
import importlib.util
import sys

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import slimgrad
from slimgrad.testing import assert_within_rule
from tests._threads import one_thread

# {name: statements after ``h = <saver output>``, with ``h`` written in place; returns h}
SPELLINGS = {
    "method": "h.mul_(2.0)",  # (the guard saw this one before)
    "aten_overload": "torch.ops.aten.mul_.Tensor(h, 2.0)",
    "aten_packet": "torch.ops.aten.mul_(h, 2.0)",
    "aten_alias": "aten.add_.Scalar(h, 1.0)",
    "aten_relu_": "aten.relu_.default(h)",
    "tensor_method": "torch.Tensor.mul_(h, 2.0)",
    "tensor_dunder": "torch.Tensor.__iadd__(h, 1.0)",
    "getattr": 'getattr(h, "mul_")(2.0)',
    "getattr_dunder": 'getattr(h, "__imul__")(2.0)',
    "method_dunder": "h.__iadd__(1.0)",
    "F_positional": "F.leaky_relu(h, 0.1, True)",
    "helper_writes_arg": "self._write(h)",
}
# spellings where the saver's output is made inside a helper method of the module
HELPERS = {
    # the helper calls the child and writes its output
    "helper_child_write": ("h = self._child_then_write(x)", "self"),
    # the helper returns the child's output; the forward writes it
    "helper_returns_child": ("h = self._child(x)\n        h.mul_(2.0)", "self"),
    # the same, the module named otherwise in the helper and the forward
    "helper_named_mod": ("h = mod._child_mod(x)\n        h.mul_(2.0)", "mod"),
}
SAVERS = {
    "LayerNorm": lambda: nn.LayerNorm(8),
    "RMSNorm": lambda: nn.RMSNorm(8),
    "GroupNorm": lambda: nn.GroupNorm(2, 8),
    "LlamaRMSNorm": lambda: LlamaRMSNorm(8),
    "GELU": lambda: nn.GELU(),
    "SiLU": lambda: nn.SiLU(),
    "Mish": lambda: nn.Mish(),
    "ELU": lambda: nn.ELU(),
    "LeakyReLU": lambda: nn.LeakyReLU(0.2),
    "Hardswish": lambda: nn.Hardswish(),
    "BatchNorm+GELU": lambda: nn.Sequential(nn.BatchNorm1d(8), nn.GELU()),
    "BatchNorm+SiLU": lambda: nn.Sequential(nn.BatchNorm1d(8), nn.SiLU()),
}

_HEAD = """
import torch
import torch.nn.functional as F
from torch import nn

aten = torch.ops.aten


class Base(nn.Module):
    def __init__(self, saver):
        super().__init__()
        self.pre, self.saver, self.post = nn.Linear(8, 8), saver, nn.Linear(8, 8)

    def _write(self, t):
        t.mul_(2.0)

    def _child(self, x):
        return self.saver(x)

    def _child_mod(mod, x):
        return mod.saver(x)

    def _child_then_write(self, x):
        y = self.saver(x)
        y.mul_(2.0)
        return y
"""
# data-dependent control flow: torch.fx cannot trace it, so the guard reads the source
_UNTRACEABLE = "if x.sum() > 1e30:\n            x = x * 1.0\n        "


def _source() -> str:
    out = [_HEAD]
    for traced in (True, False):
        cond = "" if traced else _UNTRACEABLE
        for name, stmt in SPELLINGS.items():
            out.append(
                f"\n\nclass {name}_{traced}(Base):\n    def forward(self, x):\n"
                f"        x = self.pre(x)\n        {cond}h = self.saver(x)\n        {stmt}\n"
                "        return self.post(h)\n"
            )
        for name, (stmts, me) in HELPERS.items():
            out.append(
                f"\n\nclass {name}_{traced}(Base):\n    def forward({me}, x):\n"
                f"        x = {me}.pre(x)\n        {cond}{stmts}\n"
                f"        return {me}.post(h)\n"
            )
        out.append(
            f"\n\nclass NoWrite_{traced}(Base):\n    def forward(mod, x):\n"
            f"        x = mod.pre(x)\n        {cond}h = mod._child_mod(x)\n"
            "        h = aten.add.Tensor(h, 1.0) + getattr(h, 'mul')(2.0)\n"
            "        h = F.leaky_relu(h, 0.1, False) + torch.Tensor.mul(h, 2.0)\n"
            "        return mod.post(h)\n"
        )
    return "".join(out)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    # the forwards live in a file: the guard reads a forward's source (inspect.getsource)
    path = tmp_path_factory.mktemp("spellings") / "_inplace_spellings_models.py"
    path.write_text(_source())
    spec = importlib.util.spec_from_file_location("_inplace_spellings_models", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def _step(model, x):
    try:
        loss = model(x.clone()).square().sum()
        loss.backward()
    except RuntimeError as e:
        return ("error", "modified by an inplace operation" in str(e)), None
    grads = [p.grad.clone() for p in model.parameters()]
    return loss.detach(), grads


ALL = [*SPELLINGS, *HELPERS]


# (spelling, saver, traced): of the 360 (every spelling x saver x traced/source), the rows that
# together run every coverage arc (branch arcs of src/slimgrad and this file: the error/bitwise/
# BatchNorm-rule outcomes too) any of them runs, with every (spelling, traced) and every (saver,
# traced) pair kept
ROWS = [
    ("method", "LayerNorm", True),
    ("method", "LayerNorm", False),
    ("method", "LlamaRMSNorm", True),
    ("method", "BatchNorm+GELU", True),
    ("method", "BatchNorm+SiLU", True),
    ("aten_overload", "ELU", True),
    ("aten_overload", "Hardswish", False),
    ("aten_packet", "SiLU", True),
    ("aten_packet", "ELU", False),
    ("aten_alias", "RMSNorm", True),
    ("aten_alias", "Hardswish", False),
    ("aten_relu_", "GroupNorm", False),
    ("aten_relu_", "LlamaRMSNorm", True),
    ("tensor_method", "Mish", True),
    ("tensor_method", "BatchNorm+GELU", False),
    ("tensor_dunder", "GroupNorm", True),
    ("tensor_dunder", "GroupNorm", False),
    ("getattr", "SiLU", False),
    ("getattr", "ELU", True),
    ("getattr_dunder", "GELU", False),
    ("getattr_dunder", "ELU", True),
    ("method_dunder", "LeakyReLU", False),
    ("method_dunder", "Hardswish", True),
    ("F_positional", "RMSNorm", False),
    ("F_positional", "GELU", True),
    ("F_positional", "LeakyReLU", False),
    ("helper_writes_arg", "LlamaRMSNorm", False),
    ("helper_writes_arg", "GELU", True),
    ("helper_child_write", "LeakyReLU", True),
    ("helper_child_write", "BatchNorm+SiLU", False),
    ("helper_returns_child", "RMSNorm", True),
    ("helper_returns_child", "SiLU", False),
    ("helper_named_mod", "LayerNorm", True),
    ("helper_named_mod", "Mish", False),
]


@pytest.mark.parametrize(
    "spelling,saver,traced",
    [pytest.param(*r, id=f"{r[0]}-{r[1]}-{'traced' if r[2] else 'source'}") for r in ROWS],
)
def test_written_output_trains_as_eager(models, spelling, saver, traced):
    torch.manual_seed(0)
    eager = getattr(models, f"{spelling}_{traced}")(SAVERS[saver]()).train()
    conv, ref = copy.deepcopy(eager), copy.deepcopy(eager).double()
    slimgrad.convert_(conv)
    x = torch.randn(
        80, 8
    )  # above 512 elements: the smooth activations keep y (NOTE [Few elements])
    want, want_g = _step(eager, x)
    got, got_g = _step(conv, x)
    if want_g is None:  # eager raises too (its own op keeps what is written)
        assert got == want
        return
    assert got_g is not None, f"converted raised where eager trains: {slimgrad.report(conv)}"
    if not saver.startswith("BatchNorm"):  # a module the guard keeps runs eager's op
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        for a, b in zip(got_g, want_g, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        return
    # BatchNorm converts (it keeps what the activation needs, not the activation's output): its
    # op rounds otherwise, so the error rule against float64
    ref64, ref64_g = _step(ref, x.double())
    assert_within_rule([got, *got_g], [ref64, *ref64_g], [want, *want_g])


@pytest.mark.parametrize("spelling", ALL)
def test_the_report_names_the_write(models, spelling):
    # the kept module is named in the report with the guard's reason
    eager = getattr(models, f"{spelling}_False")(nn.LayerNorm(8))
    slimgrad.convert_(eager)
    rows = [r for r in slimgrad.report(eager).skipped if r[0] == "saver"]
    assert rows and "an in-place write follows it" in rows[0][2], rows


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "source"])
def test_no_write_keeps_the_saving(models, traced):
    # the reader still converts where nothing writes: out-of-place spellings, a helper that only
    # returns the child's output, the module named otherwise
    m = getattr(models, f"NoWrite_{traced}")(nn.LayerNorm(8))
    slimgrad.convert_(m)
    assert type(m.saver).__module__.startswith("slimgrad."), slimgrad.report(m)
