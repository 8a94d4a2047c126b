import pytest
import torch
from torch import nn

from slimgrad.convert_handlers.cnn import HANDLERS
from slimgrad.memory import measure
from slimgrad.nn import conv as sconv

PAIRS = [
    (sconv.Conv1d, nn.Conv1d, (3, 4, 3), dict(stride=2, padding=1, padding_mode="reflect"), 1),
    (sconv.Conv2d, nn.Conv2d, (3, 6, (3, 2)), dict(padding=(1, 2), groups=3, bias=False), 2),
    (sconv.Conv2d, nn.Conv2d, (3, 4, 3), dict(padding=1, padding_mode="circular"), 2),
    (sconv.Conv3d, nn.Conv3d, (2, 3, 2), dict(padding=1, padding_mode="replicate"), 3),
    (sconv.ConvTranspose1d, nn.ConvTranspose1d, (3, 4, 3), dict(stride=2), 1),
    (sconv.ConvTranspose2d, nn.ConvTranspose2d, (3, 4, 3), dict(stride=2, dilation=2), 2),
    (sconv.ConvTranspose3d, nn.ConvTranspose3d, (2, 2, 2), dict(stride=2, bias=False), 3),
]


def _x(cin, nd):
    return torch.randn(2, cin, *([7, 6, 5][:nd] if nd < 3 else [4, 3, 5]))


@pytest.mark.parametrize("ours,theirs,args,kw,nd", PAIRS)
def test_from_torch_shares_parameters_and_matches(ours, theirs, args, kw, nd):
    ref = theirs(*args, **kw)
    calls = []
    ref.register_forward_hook(lambda m, i, o: calls.append(1))
    m = ours.from_torch(ref)
    assert isinstance(m, theirs)
    assert list(m.state_dict()) == list(ref.state_dict())
    for a, b in zip(m.parameters(), ref.parameters()):
        assert a is b
    x0 = _x(args[0], nd)
    outs = []
    for mod in (m, ref):
        mod.zero_grad()
        x = x0.clone().requires_grad_()
        y = mod(x)
        y.backward(torch.ones_like(y) * 0.5)
        outs.append([y, x.grad] + [p.grad.clone() for p in mod.parameters()])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b)
    assert len(calls) == 2  # the hook moved with the module
    m.register_forward_hook(lambda mod, i, o: None)
    assert len(m._forward_hooks) == 2 and len(ref._forward_hooks) == 1  # own hook dicts


@pytest.mark.parametrize("ours,theirs,args,kw,nd", PAIRS)
def test_same_constructor_and_state_dict_loads(ours, theirs, args, kw, nd):
    torch.manual_seed(1)
    a = theirs(*args, **kw)
    b = ours(*args, **kw)
    b.load_state_dict(a.state_dict())
    x = _x(args[0], nd)
    torch.testing.assert_close(a(x), b(x))


def test_transposed_output_size_and_padding_mode_error():
    m = sconv.ConvTranspose2d(3, 2, 3, stride=2)
    ref = nn.ConvTranspose2d(3, 2, 3, stride=2)
    ref.load_state_dict(m.state_dict())
    x = torch.randn(1, 3, 5, 5)
    torch.testing.assert_close(m(x, output_size=[12, 12]), ref(x, output_size=[12, 12]))
    m.padding_mode = "reflect"
    with pytest.raises(ValueError, match=r"slimgrad.nn.ConvTranspose2d: padding_mode"):
        m(x)


def test_from_torch_refuses_subclass():
    class MyConv(nn.Conv2d):
        pass

    with pytest.raises(TypeError, match=r"slimgrad.nn.Conv2d.from_torch: module type"):
        sconv.Conv2d.from_torch(MyConv(2, 2, 1))


def test_frozen_module_keeps_no_input():
    conv = nn.Conv2d(4, 6, 3, padding=1)
    conv.requires_grad_(False)
    m = HANDLERS[nn.Conv2d](conv)
    x0 = torch.randn(2, 4, 11, 9)

    def step(mod):
        return lambda: mod((x0 * 1).requires_grad_() * 2).sum()

    assert measure(step(m)).saved_bytes == 0
    assert measure(step(conv)).saved_bytes == x0.numel() * 4
