"""The smooth activations (GELU erf/tanh, SiLU, Mish) return eager's output bit for bit on inputs
that are not contiguous (NOTE [Eager's output on a strided input] in slimgrad/ops/_output_act.py).

Eager's CPU kernels give different float32 bits for the same value depending on the loop that
reaches it (vectorized over a contiguous run, or a row's scalar tail): ``F.gelu`` on a sliced
tensor differs from ``F.gelu`` on its contiguous copy in thousands of elements by an ulp. HF
Wav2Vec2's positional conv embedding feeds ``conv(x)[:, :, :-1]`` (SamePad) to its GELU; the op
computed y on a contiguous copy, and on the tiny Wav2Vec2ForCTC of issue 30 (CTC sum loss 667)
those ulps took 19 gradients outside the error rule in ``slimgrad.verify``'s eval run
(lm_head.weight 1.73e-4 against a bound of 1.07e-4).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slimgrad
from slimgrad.kernels import _backend
from slimgrad.ops.gelu import gelu
from slimgrad.ops.mish import mish
from slimgrad.ops.silu import silu
from slimgrad.testing import assert_within_rule

OPS = {
    "gelu": (lambda t: gelu(t), F.gelu),
    "gelu_tanh": (lambda t: gelu(t, approximate="tanh"), lambda t: F.gelu(t, approximate="tanh")),
    "silu": (silu, F.silu),
    "mish": (mish, F.mish),
}


def _layouts(x: torch.Tensor) -> dict[str, torch.Tensor]:
    # x: (2, 32, 80); every entry keeps more than DENSE_MAX (512) elements
    return {
        "slice_last": x[:, :, :-1],  # SamePad: rows of 79 (vector body + scalar tail)
        "slice_step": x[:, :, ::2],
        "slice_mid": x[:, 3:29, 5:],
        "transposed": x.transpose(1, 2),  # dense, other memory order
        "channels_last": x.view(2, 32, 8, 10).contiguous(memory_format=torch.channels_last),
        "expanded": x[0, :1].expand(40, 80),
        "contiguous": x,
    }


def _input() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(2, 32, 80) * 1.5


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("layout", sorted(_layouts(torch.empty(2, 32, 80))))
@pytest.mark.parametrize("name", sorted(OPS))
def test_output_is_eagers_on_every_layout(name, layout, backend):
    op, ref = OPS[name]
    x = _layouts(_input())[layout]
    with _backend.set_backend(backend):
        y = op(x.detach().requires_grad_(True))
    want = ref(x)
    assert y.shape == want.shape
    assert torch.equal(y, want), (name, layout, backend, int((y != want).sum()))


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("name", ["gelu", "silu", "mish"])
def test_inplace_output_is_eagers_on_a_slice(name, backend):
    # in place over a non-leaf slice: the bits eager's out-of-place op gives on that slice
    fn = {"gelu": gelu, "silu": silu, "mish": mish}[name]
    leaf = _input().requires_grad_(True)
    base = leaf * 1.0
    x = base[:, :, :-1]
    want = OPS[name][1](x.detach())
    with _backend.set_backend(backend):
        assert fn(x, inplace=True) is x
    assert torch.equal(x.detach(), want), (name, backend, int((x != want).sum()))


def test_eager_differs_between_layouts():
    # the premise: without it the test above could not fail (AVX2/AVX512 and scalar CPUs alike
    # compute some rows' tails in another loop than a contiguous run's body)
    x = _input()[:, :, :-1]
    assert any(not torch.equal(ref(x), ref(x.contiguous())) for _, ref in OPS.values())


class _PosConv(nn.Module):
    # HF Wav2Vec2PositionalConvEmbedding's shape: conv with even kernel, SamePad, GELU, transpose
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(16, 16, 16, padding=8, groups=4)
        self.act = nn.GELU()
        self.fc = nn.Linear(16, 7)

    def forward(self, x):
        h = self.conv(x.transpose(1, 2))[:, :, :-1]
        return self.fc(self.act(h).transpose(1, 2))


def test_samepad_gelu_forward_bits_as_eager():
    torch.manual_seed(0)
    eager = _PosConv()
    conv = slimgrad.convert_(copy.deepcopy(eager))
    assert type(conv.act).__module__.startswith("slimgrad."), type(conv.act)
    x = torch.randn(2, 79, 16)
    out_e, out_c = eager(x), conv(x)
    assert torch.equal(out_c, out_e)
    ref = copy.deepcopy(eager).double()

    def grads(m, xx):
        xx = xx.detach().clone().requires_grad_(True)
        (m(xx).square().sum() * 100).backward()
        return [xx.grad] + [p.grad for p in m.parameters()]

    assert_within_rule(grads(conv, x), grads(ref, x.double()), grads(eager, x))
