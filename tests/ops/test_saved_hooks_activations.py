"""Issue 33: the lean activations, squeeze-excite and drop_path under ``saved_tensors_hooks``.

What each op keeps goes through ``save_for_backward`` (the pack hook sees it; no full-size tensor
is left as a ctx attribute), the pack hook sees no more bytes than eager's op gives it (NOTE
[Output and side information under saved-tensor hooks] in ``slimgrad.ops._monotone``), and the
gradients under ``save_on_cpu`` are the op's own without hooks (ELU and Hardswish: eager's, the
path they take there).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slimgrad.ops.drop_path import drop_path
from slimgrad.ops.elu import elu
from slimgrad.ops.hardsigmoid import hardsigmoid
from slimgrad.ops.hardswish import hardswish
from slimgrad.ops.hardtanh import hardtanh
from slimgrad.ops.leaky_relu import leaky_relu
from slimgrad.ops.relu import relu
from slimgrad.ops.squeeze_excite import squeeze_excite

X = torch.randn(4, 32, 16, 16, generator=torch.Generator().manual_seed(0))
GATE = torch.randn(4, 32, 1, 1, generator=torch.Generator().manual_seed(1)).sigmoid()

# name: (slimgrad op, eager op, gradient under hooks is eager's)
OPS = {
    "elu": (elu, F.elu, True),
    "elu_neg": (lambda x: elu(x, -0.5), lambda x: F.elu(x, -0.5), True),
    "hardswish": (hardswish, F.hardswish, True),
    "hardsigmoid": (hardsigmoid, F.hardsigmoid, False),
    "leaky_relu": (lambda x: leaky_relu(x, 0.1), lambda x: F.leaky_relu(x, 0.1), False),
    "leaky_relu_neg": (lambda x: leaky_relu(x, -0.2), lambda x: F.leaky_relu(x, -0.2), False),
    "hardtanh": (hardtanh, F.hardtanh, False),
    "relu": (relu, F.relu, False),
    "squeeze_excite": (lambda x: squeeze_excite(x, GATE), lambda x: x * GATE, False),
    "drop_path": (
        lambda x: (torch.manual_seed(3), drop_path(x, 0.3, True))[1],
        lambda x: x * (torch.manual_seed(3), (torch.rand(4, 1, 1, 1) >= 0.3).float() / 0.7)[1],
        False,
    ),
}


def _step(fn, hooks):
    x = X.clone().requires_grad_()
    seen: list[int] = []

    def pack(t):
        seen.append(t.untyped_storage().nbytes())
        return t

    ctx = {
        "count": lambda: torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        "cpu": torch.autograd.graph.save_on_cpu,
    }.get(hooks)
    h = x * 1  # a layer's output, as in a model
    if hooks is None:
        y = fn(h)
    else:
        with ctx():
            y = fn(h)
    w = torch.linspace(-1, 1, y.numel()).view_as(y)
    (y * w).sum().backward()
    return sum(seen), x.grad


@pytest.mark.parametrize("name", list(OPS))
def test_pack_hook_sees_no_more_than_eager(name):
    slim, eager, _ = OPS[name]
    got, _ = _step(slim, "count")
    ref, _ = _step(eager, "count")
    assert got <= ref, (name, got, ref)


@pytest.mark.parametrize("name", list(OPS))
def test_gradients_under_save_on_cpu(name):
    slim, eager, eager_under_hooks = OPS[name]
    _, g_cpu = _step(slim, "cpu")
    _, g_plain = _step(eager if eager_under_hooks else slim, None)
    assert torch.equal(g_cpu, g_plain), name
    if name != "drop_path":  # its eager stand-in draws its mask another way
        _, g_eager = _step(eager, None)
        torch.testing.assert_close(g_cpu, g_eager)
