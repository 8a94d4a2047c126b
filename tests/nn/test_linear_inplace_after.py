"""An in-place consumer after a converted Linear / HF Conv1D costs eager's bytes (issue 30).

Eager's bias-free linear of an input of 3+ dims returns matmul's _unsafe_view (not a view): an
in-place write on it is a plain in-place op. Viewing slimgrad's 2-D product instead made autograd
rebase the write onto the product (CopySlices), up to two gradients' bytes above eager's peak.
Each row: module x rank x in-place consumer x dtype; saved and peak bytes (slimgrad's tracker)
never above eager's, and the gradients bit for bit. NOTE [Linear's N-D output without bias] in
slimgrad/ops/linear.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.memory import measure

hf = pytest.importorskip("transformers.pytorch_utils")

MODULES = {
    "Linear": lambda: nn.Linear(64, 48),
    "Linear-nobias": lambda: nn.Linear(64, 48, bias=False),
    "Conv1D": lambda: hf.Conv1D(48, 64),
}
POSTS = {
    "relu_": lambda y: y.relu_(),
    "mul_": lambda y: y.mul_(2.0),
    "add_": lambda y: y.add_(1.0),
    "sigmoid_": lambda y: y.sigmoid_(),
    "clamp_": lambda y: y.clamp_(-0.5, 0.5),
    "ReLU-inplace": nn.ReLU(inplace=True),
    "none": lambda y: y,
}
SHAPES = [(7, 64), (4, 10, 64), (2, 3, 5, 64), (2, 1, 3, 5, 64)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("post", list(POSTS))
@pytest.mark.parametrize("name", list(MODULES))
def test_inplace_after_linear_bytes_and_bits_as_eager(name, post, dtype):
    torch.manual_seed(0)
    eager = nn.Sequential(MODULES[name]()).to(dtype)  # convert_ converts children only
    ours = slimgrad.convert_(copy.deepcopy(eager))
    assert type(ours[0]).__module__.startswith("slimgrad."), slimgrad.report(ours)
    failures = []
    for shape in SHAPES:
        res = []
        for mod in (eager, ours):
            x = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(dtype)
            x.requires_grad_()

            def step(mod=mod, x=x):
                return POSTS[post](mod(x * 1)).pow(2).sum()

            mod.zero_grad(set_to_none=True)
            x.grad = None
            step().backward()  # warm-up, and the gradients compared
            grads = [x.grad.clone()] + [p.grad.clone() for p in mod.parameters()]
            # with .grad set (accumulation: where the rebase's buffers made the peak) and unset
            kept = measure(step, timeline=False)
            mod.zero_grad(set_to_none=True)
            res.append(((kept, measure(step, timeline=False)), grads))
        ((me, me0), ge), ((mo, mo0), go) = res
        # HF Conv1D on a 2-D input returns a view of addmm's product, and eager's output-saving
        # in-place op on it keeps its result inside a CopySlices node, whose saved tensors the
        # tracker does not list (eager's saved bytes are short of that result: (7, 32) -> 24
        # relu_ 896 against 1,568 kept; the peaks are equal): peak only there
        hidden = name == "Conv1D" and len(shape) == 2 and post not in ("mul_", "add_", "none")
        if (mo0.saved_bytes > me0.saved_bytes and not hidden) or mo0.peak_bytes > me0.peak_bytes:
            failures.append(f"{shape}, .grad unset: {mo0.peak_bytes} (eager {me0.peak_bytes})")
        if (mo.saved_bytes > me.saved_bytes and not hidden) or mo.peak_bytes > me.peak_bytes:
            failures.append(
                f"{shape}: saved {mo.saved_bytes} (eager {me.saved_bytes}), peak "
                f"{mo.peak_bytes} (eager {me.peak_bytes})"
            )
        if not all(torch.equal(a, b) for a, b in zip(ge, go, strict=True)):
            failures.append(f"{shape}: gradients differ from eager's")
    assert not failures, "\n".join(failures)
