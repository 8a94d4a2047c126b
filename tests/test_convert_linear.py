"""convert_ of plain nn.Linear (NOTE [Which Linears convert] in convert_handlers/linear.py).

A converted Linear gives eager's output and gradients bit for bit (fp32, bf16, inputs in every
layout, hooks), and under autocast keeps no weight cast; MultiheadAttention's out_proj stays; a
PEFT LoRA layer keeps its wrapper and its base_layer converts, LoRA's output and gradients exact.
"""

import copy

import pytest
import torch
import torch.nn as nn

import slimgrad
import slimgrad.nn as snn
from slimgrad.memory import measure


def _same(a, b):
    assert (a is None) == (b is None)
    if a is not None:
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _step(model, x, autocast=None):
    x = x.detach().requires_grad_()
    with torch.autocast("cpu", autocast or torch.bfloat16, enabled=autocast is not None):
        y = model(x)
    y.float().square().sum().backward()
    out = [y.detach(), x.grad]
    out += [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


INPUTS = {
    "2d": lambda: torch.randn(7, 13),
    "3d": lambda: torch.randn(2, 5, 13),
    "1d": lambda: torch.randn(13),
    # eager's mm computes a column-major input's gradient in another layout: eager's path runs
    "transposed": lambda: torch.randn(13, 7).t(),
    "strided": lambda: torch.randn(2, 5, 26)[..., ::2],
}


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kind", sorted(INPUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_converted_linear_bit_for_bit(dtype, kind, bias, autocast):
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(13, 9, bias=bias), nn.Tanh(), nn.Linear(9, 6, bias=bias))
    eager = eager.to(dtype)
    conv = slimgrad.convert_(copy.deepcopy(eager))
    assert type(conv[0]) is snn.Linear and type(conv[2]) is snn.Linear
    x = INPUTS[kind]().to(dtype)
    for a, b in zip(_step(conv, x, autocast), _step(eager, x, autocast), strict=True):
        _same(a, b)


def test_hooks_carried_and_honoured():
    torch.manual_seed(1)
    eager = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 3))
    seen = []
    eager[0].register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    eager[1].register_forward_hook(lambda m, args, out: seen.append(out.detach()) or out + 1)
    conv = slimgrad.convert_(copy.deepcopy(eager))
    assert type(conv[0]) is snn.Linear and type(conv[1]) is snn.Linear
    x = torch.randn(4, 6)
    for a, b in zip(_step(conv, x), _step(eager, x), strict=True):
        _same(a, b)
    assert len(seen) == 2
    _same(seen[0], seen[1])


def test_multihead_attention_out_proj_stays():
    torch.manual_seed(2)
    eager = nn.MultiheadAttention(8, 2, batch_first=True)
    conv = slimgrad.convert_(copy.deepcopy(eager))
    assert type(conv.out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear
    why = [r for n, _, r in slimgrad.report(conv).skipped if n == "out_proj"]
    assert why and "reads its weight directly" in why[0]
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(conv(x, x, x)[0], eager(x, x, x)[0], rtol=0, atol=0)


def test_lora_base_layer_converts_and_lora_stays_exact():
    peft = pytest.importorskip("peft")
    torch.manual_seed(3)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = nn.Linear(12, 12)
            self.o = nn.Linear(12, 5)

        def forward(self, x):
            return self.o(torch.tanh(self.q(x)))

    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q", "o"], lora_dropout=0.0)
    eager = peft.get_peft_model(Net(), cfg)
    for n, p in eager.named_parameters():  # LoRA's B starts at 0: give it values
        if "lora_B" in n:
            nn.init.normal_(p)
    conv = slimgrad.convert_(copy.deepcopy(eager))
    q = conv.base_model.model.q
    assert type(q).__module__.startswith("peft.")  # the LoRA wrapper stays (its own forward)
    assert type(q.base_layer) is snn.Linear
    assert type(q.lora_A["default"]) is snn.Linear and type(q.lora_B["default"]) is snn.Linear
    x = torch.randn(3, 4, 12)
    for autocast in (None, torch.bfloat16):
        for a, b in zip(_step(conv, x, autocast), _step(eager, x, autocast), strict=True):
            _same(a, b)
    # under autocast eager keeps every weight's cast for dx (frozen base weights and LoRA's A, B);
    # slimgrad keeps nothing new (the weights themselves)
    xs = torch.randn(3, 4, 12, requires_grad=True)

    def saved(m):
        def fwd():
            with torch.autocast("cpu", torch.bfloat16):
                return m(xs * 1).float().sum()

        return measure(fwd).saved_bytes

    base = 12 * 12 + 5 * 12  # q's and o's base weights
    lora = (4 * 12 + 12 * 4) + (4 * 12 + 5 * 4)  # A and B of q and o
    assert saved(eager) - saved(conv) == 2 * (base + lora)


def test_state_dict_and_idempotent():
    eager = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2, bias=False))
    sd = eager.state_dict()
    conv = slimgrad.convert_(copy.deepcopy(eager))
    assert list(conv.state_dict()) == list(sd)
    conv.load_state_dict(sd)
    assert slimgrad.report(slimgrad.convert_(conv)).converted == []
