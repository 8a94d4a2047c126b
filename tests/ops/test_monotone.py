"""The monotone-activation factory (ops/_monotone.py): what each op's Function keeps, and names."""

import importlib

import pytest
import torch
import torch.nn.functional as F

from slimgrad.memory import measure
from slimgrad.ops.elu import TAIL

# stem, args, eager, node name, saved bytes per element of float32 x (bits: 1/8)
CASES = [
    ("relu", (), F.relu, "_ReluFnBackward", 4),
    ("sigmoid", (), torch.sigmoid, "_SigmoidFnBackward", 4),
    ("tanh", (), torch.tanh, "_TanhFnBackward", 4),
    ("leaky_relu", (0.2,), F.leaky_relu, "_LeakyReluFnBackward", 4),
    ("leaky_relu", (-0.3,), F.leaky_relu, "_LeakyReluBitsFnBackward", 1 / 8),
    # elu: + 8 B per element below its tail (NOTE [ELU's tail])
    ("elu", (0.7,), F.elu, "_EluFnBackward", lambda x: 4 + 8 * float((x < TAIL).float().mean())),
    (
        "elu",
        (-0.5,),
        F.elu,
        "_EluFnBackward",
        lambda x: 4.125 + 8 * float((x < TAIL).float().mean()),
    ),
    ("hardtanh", (-0.5, 1.5), F.hardtanh, "_HardtanhFnBackward", 4),
]


@pytest.mark.parametrize("stem,args,eager,node,per_elt", CASES)
@pytest.mark.parametrize("inplace", [False, True])
def test_node_saved_bytes_and_grads(stem, args, eager, node, per_elt, inplace):
    fn = getattr(importlib.import_module(f"slimgrad.ops.{stem}"), stem)
    torch.manual_seed(0)
    x0 = torch.randn(8, 67, requires_grad=True)  # 536 elements: above the small-tensor cutoff (512)
    x0.data[0, :3] = torch.tensor([-2.5, -7.0, -30.0])  # elu: tail elements
    y = fn(x0 * 1, *args, inplace=inplace)
    assert type(y.grad_fn).__name__ == node
    m = measure(lambda: fn(x0 * 1, *args, inplace=inplace).sum())
    per_elt = per_elt(x0) if callable(per_elt) else per_elt
    if stem == "elu" and inplace and args[0] > 0:
        per_elt = 4  # y alone, as eager's elu_ (NOTE [ELU in place] in ops/elu.py)
    assert m.saved_bytes == round(per_elt * x0.numel())
    (got,) = torch.autograd.grad(fn(x0 * 1, *args, inplace=inplace).square().sum(), x0)
    (want,) = torch.autograd.grad(eager(x0 * 1, *args).square().sum(), x0)
    torch.testing.assert_close(got, want)  # elu: y + alpha vs alpha e^x, within rounding


def test_bwd_torch_keeps_defaults_and_hardtanh_bits_in_bfloat16():
    ops = {s: importlib.import_module(f"slimgrad.ops.{s}") for s in ("leaky_relu", "elu")}
    g, y = torch.randn(5, 7), torch.randn(5, 7)
    torch.testing.assert_close(
        ops["leaky_relu"]._bwd_torch(g, y), torch.ops.aten.leaky_relu_backward(g, y, 0.01, True)
    )
    torch.testing.assert_close(
        ops["elu"]._bwd_torch(g, y), torch.ops.aten.elu_backward(g, 1.0, 1.0, 1.0, True, y)
    )
    from slimgrad.ops.hardtanh import hardtanh

    x0 = torch.randn(8, 13, dtype=torch.bfloat16, requires_grad=True)
    y = hardtanh(x0 * 1, -0.7, 0.7)  # 0.7 is not a bfloat16: 1 bit/elt
    assert type(y.grad_fn).__name__ == "_HardtanhBitsFnBackward"
    m = measure(lambda: hardtanh(x0 * 1, -0.7, 0.7).sum())
    assert m.saved_bytes == x0.numel() // 8
