"""A converted Linear / HF Conv1D accepts exactly the inputs the original accepts (issue 30).

HF's Conv1D views its input (``x.view(-1, nx)``) and raises on one whose leading dims do not fold
into rows (transposed, permuted, expanded, channels_last); ``F.linear`` reshapes any input. Each row
runs the original and ``convert_``'s replacement on one input layout, rank, dtype and context and
asserts the same outcome: the same exception type and message, or the same bits (output and
gradients). NOTE [Conv1D views its input] in slimgrad/ops/linear.py.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

import slimgrad

hf = pytest.importorskip("transformers.pytorch_utils")

# name -> input of last dim 6 (or 5 where the features do not match)
LAYOUTS = {
    "contiguous-3d": lambda: torch.randn(3, 4, 6),
    "transposed-3d": lambda: torch.randn(4, 3, 6).transpose(0, 1),
    "transposed-last-3d": lambda: torch.randn(3, 6, 4).transpose(1, 2),
    "expanded-3d": lambda: torch.randn(1, 4, 6).expand(3, 4, 6),
    "expanded-rows-3d": lambda: torch.randn(3, 1, 6).expand(3, 4, 6),
    "strided-last-3d": lambda: torch.randn(3, 4, 12)[..., ::2],
    "sliced-rows-3d": lambda: torch.randn(3, 8, 6)[:, ::2],
    "channels-last-4d": lambda: torch.randn(2, 6, 3, 6).contiguous(
        memory_format=torch.channels_last
    ),
    "permuted-4d": lambda: torch.randn(2, 3, 4, 6).permute(1, 0, 2, 3),
    "expanded-4d": lambda: torch.randn(2, 1, 4, 6).expand(2, 3, 4, 6),
    "transposed-2d": lambda: torch.randn(6, 4).t(),
    "strided-2d": lambda: torch.randn(4, 12)[:, ::2],
    "expanded-2d": lambda: torch.randn(1, 6).expand(4, 6),
    "1d": lambda: torch.randn(6),
    "strided-1d": lambda: torch.randn(12)[::2],
    "0d": lambda: torch.tensor(1.0),
    "empty-3d": lambda: torch.randn(0, 4, 6),
}

MODULES = {
    "Conv1D": lambda: hf.Conv1D(5, 6),
    "Linear": lambda: nn.Linear(6, 5),
    "Linear-nobias": lambda: nn.Linear(6, 5, bias=False),
}

CONTEXTS = {
    "grad": contextlib.nullcontext,
    "no_grad": torch.no_grad,
    "autocast-bf16": lambda: torch.autocast("cpu", torch.bfloat16),
}


def _outcome(mod, x, ctx, x_req):
    for p in mod.parameters():
        p.grad = None
    x = x.detach().requires_grad_(x_req)
    try:
        with CONTEXTS[ctx]():
            y = mod(x)
        if y.requires_grad:
            (y.float() * torch.arange(y.numel()).view(y.shape).sin()).sum().backward()
        return [y.detach(), x.grad] + [p.grad for p in mod.parameters()]
    except Exception as e:  # noqa: BLE001 - the outcome compared is the exception itself
        return (type(e), str(e))


def _cases():
    for name in MODULES:
        for ctx in CONTEXTS:
            for dtype in (torch.float32, torch.bfloat16):
                if ctx.startswith("autocast") and dtype != torch.float32:
                    continue  # autocast casts float32 inputs
                for layouts in ("t2d", "rest"):
                    yield pytest.param(
                        name,
                        ctx,
                        dtype,
                        ["transposed-2d"]
                        if layouts == "t2d"
                        else [k for k in LAYOUTS if k != "transposed-2d"],
                        id=f"{name}-{ctx}-{str(dtype)[6:]}-{layouts}",
                    )


@pytest.mark.parametrize("name,ctx,dtype,layouts", list(_cases()))
def test_converted_accepts_and_refuses_as_the_original(name, ctx, dtype, layouts):
    torch.manual_seed(0)
    eager = nn.Sequential(MODULES[name]()).to(dtype)
    ours = slimgrad.convert_(copy.deepcopy(eager))
    assert type(ours[0]).__module__.startswith("slimgrad."), slimgrad.report(ours)
    diffs = []
    for layout in layouts:
        torch.manual_seed(1)
        x = LAYOUTS[layout]().to(dtype)
        for x_req in (False, True):
            a, b = _outcome(eager, x, ctx, x_req), _outcome(ours, x, ctx, x_req)
            if isinstance(a, tuple) or isinstance(b, tuple):
                if not (isinstance(a, tuple) and isinstance(b, tuple) and a == b):
                    diffs.append(f"{layout} x_req={x_req}: eager {a!r:.160} ours {b!r:.160}")
                continue
            same = all(
                (u is None and v is None) or (u is not None and v is not None and torch.equal(u, v))
                for u, v in zip(a, b, strict=True)
            )
            if not same:
                diffs.append(f"{layout} x_req={x_req}: different bits")
    assert not diffs, "\n".join(diffs)


@pytest.mark.parametrize("name", list(MODULES))
def test_mismatched_features_raise_runtime_error_as_the_original(name):
    # the type eager raises (its message is addmm's; slimgrad's names the layer's in_features)
    eager = nn.Sequential(MODULES[name]())
    ours = slimgrad.convert_(copy.deepcopy(eager))
    for shape in ((3, 4, 5), (4, 5), (5,)):
        for m in (eager, ours):
            with pytest.raises(RuntimeError):
                m(torch.randn(shape))
