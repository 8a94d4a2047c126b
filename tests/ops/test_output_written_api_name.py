"""The error for a kept smooth-activation output written after forward names the public op
(``slimgrad.ops.gelu``, not the private ``_GeluFn``) and only the ConvertConfig switch that
applies (activations, not norms): NOTE [An output written after forward] in ops/_output_act.py."""

import importlib

import pytest
import torch


@pytest.mark.parametrize("stem", ["gelu", "silu"])
def test_written_output_error_names_public_op(stem):
    fn = getattr(importlib.import_module(f"slimgrad.ops.{stem}"), stem)
    # N(1, 1): few elements in the hard window wherever this CPU's erf puts it (at N(0, 1) the
    # erf-GELU may keep x densely: NOTE [A window from eager's own forward error])
    # a non-leaf input: on a leaf that requires grad the op keeps x, as eager (NOTE [An input the
    # graph holds] in ops/_output_act.py)
    x = torch.randn(64, 4096).add_(1.0).requires_grad_() * 1.0
    y = fn(x)
    z = y * 2.0
    y.add_(1.0)
    with pytest.raises(RuntimeError) as info:
        z.sum().backward()
    msg = str(info.value)
    if not msg.startswith("slimgrad."):
        pytest.skip("this size kept the input: no slimgrad error to check")
    assert msg.startswith(f"slimgrad.ops.{stem}: "), msg[:80]
    assert "ConvertConfig(activations=False)" in msg
    assert "norms=False" not in msg
