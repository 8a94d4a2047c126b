"""slimgrad.nn.InPlaceABN / InPlaceABNSync: BatchNorm semantics, state_dict, from_torch, errors."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from slimgrad import ownership
from slimgrad.nn.inplace_abn import InPlaceABN, InPlaceABNSync


@pytest.fixture(autouse=True)
def _in_place_at_any_count(monkeypatch):
    # these tests use small shapes for the op's own path: let it run at any count per channel
    # (NOTE [Few values per channel in InPlaceABN]; tests/ops/test_abn_few_values.py covers that)
    monkeypatch.setattr(importlib.import_module("slimgrad.ops.inplace_abn"), "_MAX_FEW", 0)


BN = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}
SHAPES = {2: (6, 5), 3: (4, 5, 7), 4: (3, 5, 4, 3), 5: (2, 5, 3, 2, 3)}


def act_module(activation, param):
    if activation == "leaky_relu":
        return nn.LeakyReLU(param)
    if activation == "elu":
        return nn.ELU(param)
    return nn.Identity()


@pytest.mark.parametrize("ndim", [2, 3, 4, 5])
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"momentum": None},
        {"affine": False},
        {"track_running_stats": False},
        {"momentum": 0.3, "eps": 1e-3},
    ],
)
@pytest.mark.parametrize("activation,param", [("leaky_relu", 0.01), ("elu", 0.7), ("identity", 0)])
def test_matches_batchnorm_train_then_eval(ndim, kwargs, activation, param):
    torch.manual_seed(0)
    c = 5
    bn = BN[ndim](c, **kwargs).double()
    if bn.affine:
        with torch.no_grad():
            bn.weight.copy_(torch.randn(c))
            bn.bias.copy_(torch.randn(c))
    ref = nn.Sequential(bn, act_module(activation, param))
    bn2 = BN[ndim](c, **kwargs).double()
    bn2.load_state_dict(bn.state_dict())
    abn = InPlaceABN.from_torch(bn2, activation=activation, activation_param=param)
    for step in range(3):
        x0 = torch.randn(SHAPES[ndim], dtype=torch.float64) * (step + 1) + step
        g = torch.randn_like(x0)
        xa, xb = x0.clone().requires_grad_(), x0.clone().requires_grad_()
        out = abn(xa * 1)
        want = ref(xb)
        params = [p for p in bn2.parameters()]
        got_g = torch.autograd.grad((out * g).sum(), [xa, *params])
        want_g = torch.autograd.grad((want * g).sum(), [xb, *bn.parameters()])
        torch.testing.assert_close(out, want)
        for a, r in zip(got_g, want_g):
            torch.testing.assert_close(a, r)
        for k, v in bn.state_dict().items():
            torch.testing.assert_close(abn.state_dict()[k], v, rtol=0, atol=1e-15)
    abn.eval()
    ref.eval()
    x0 = torch.randn(SHAPES[ndim], dtype=torch.float64)
    torch.testing.assert_close(abn(x0.clone()), ref(x0))


def test_state_dict_keys_and_loading_batchnorm2d():
    bn = nn.BatchNorm2d(7)
    with torch.no_grad():
        bn.weight.uniform_(-1, 1)  # negative weights load unchanged (no |w| + eps parametrisation)
        bn.bias.uniform_(-1, 1)
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.num_batches_tracked.fill_(11)
    abn = InPlaceABN(7)
    assert list(abn.state_dict().keys()) == list(bn.state_dict().keys())
    abn.load_state_dict(bn.state_dict())
    for k, v in bn.state_dict().items():
        assert torch.equal(abn.state_dict()[k], v)
        assert abn.state_dict()[k].dtype == v.dtype
    assert [n for n, _ in abn.named_buffers()] == [n for n, _ in bn.named_buffers()]
    assert [n for n, _ in abn.named_parameters()] == [n for n, _ in bn.named_parameters()]
    bn.eval()
    abn.eval()
    x = torch.randn(2, 7, 3, 3)
    torch.testing.assert_close(abn(x.clone()), nn.functional.leaky_relu(bn(x), 0.01))
    # and back: an InPlaceABN state_dict loads into BatchNorm2d
    nn.BatchNorm2d(7).load_state_dict(abn.state_dict())


def test_old_state_dict_without_num_batches_tracked():
    bn = nn.BatchNorm2d(3)
    sd = bn.state_dict()
    del sd["num_batches_tracked"]
    sd._metadata = {"": {"version": 1}}
    abn = InPlaceABN(3)
    abn.load_state_dict(sd)
    assert int(abn.num_batches_tracked) == 0


def test_from_torch_shares_parameters_and_buffers():
    bn = nn.BatchNorm2d(4)
    abn = InPlaceABN.from_torch(bn, activation="elu", activation_param=0.5)
    assert abn.weight is bn.weight and abn.bias is bn.bias
    assert abn.running_mean is bn.running_mean and abn.running_var is bn.running_var
    assert abn.num_batches_tracked is bn.num_batches_tracked
    assert (abn.activation, abn.activation_param) == ("elu", 0.5)
    abn(torch.randn(3, 4, 2, 2))
    assert int(bn.num_batches_tracked) == 1
    assert bn.running_mean.abs().sum() > 0
    bn.eval()
    assert not InPlaceABN.from_torch(bn).training
    with pytest.raises(TypeError, match="bn must be a BatchNorm module"):
        InPlaceABN.from_torch(nn.LayerNorm(4))


def test_from_torch_sync():
    bn = nn.SyncBatchNorm(4)
    m = InPlaceABNSync.from_torch(bn, process_group=None)
    assert isinstance(m, InPlaceABNSync) and m.weight is bn.weight and m.process_group is None


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"activation": "relu"}, ValueError, "activation must be invertible"),
        ({"activation": "silu"}, ValueError, "activation must be invertible"),
        ({"activation_param": 0.0}, ValueError, "slope must be finite and > 0"),
        ({"activation": "elu", "activation_param": -1.0}, ValueError, "alpha must be finite"),
        ({"activation": 3}, TypeError, "activation must be a str"),
    ],
)
def test_construction_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match) as info:
        InPlaceABN(4, **kwargs)
    assert str(info.value).startswith("slimgrad.nn.InPlaceABN: ")
    with pytest.raises(exc, match=match) as info:
        InPlaceABNSync(4, **kwargs)
    assert str(info.value).startswith("slimgrad.nn.InPlaceABNSync: ")


def test_relu_error_message_names_the_fix():
    with pytest.raises(ValueError) as info:
        InPlaceABN(4, activation="relu")
    msg = str(info.value)
    assert "got 'relu'" in msg and "activation='leaky_relu'" in msg and msg.endswith(".")


def test_num_features_and_input_checks():
    with pytest.raises(ValueError, match="num_features must be a positive int"):
        InPlaceABN(0)
    m = InPlaceABN(4)
    with pytest.raises(ValueError, match="expected 4, got 3"):
        m(torch.randn(2, 3, 5))
    with pytest.raises(ValueError, match="expected 2D, 3D, 4D or 5D input"):
        m(torch.randn(1, 4, 1, 1, 1, 1))
    with pytest.raises(TypeError, match="input must be a Tensor"):
        m([1.0, 2.0])


def test_sync_without_distributed_raises_in_training_only():
    m = InPlaceABNSync(4)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        m(torch.randn(3, 4, 5))
    m.eval()
    x = torch.randn(3, 4, 5)
    torch.testing.assert_close(m(x.clone()), InPlaceABN(4).eval()(x.clone()))


class _Ptr(nn.Module):
    _slimgrad_fresh_output = True  # returns a new tensor it does not keep

    def __init__(self, seen):
        super().__init__()
        self.seen = seen

    def forward(self, x):
        y = x.clone()  # preserves channels_last
        self.seen.append(y.data_ptr())
        return y


def test_module_channels_last_and_repr():
    m = InPlaceABN(6, activation="elu", activation_param=1.0)
    x = torch.randn(2, 6, 4, 4).to(memory_format=torch.channels_last)
    x0 = x.clone()
    out = m(x)  # the caller still holds x: out of place, x unchanged
    assert out.data_ptr() != x.data_ptr() and torch.equal(x, x0)
    assert out.is_contiguous(memory_format=torch.channels_last)
    seen = []
    fresh = nn.Sequential(nn.Identity(), _Ptr(seen), m)  # m's input is _Ptr's fresh output
    out = fresh(x)  # no stated structure yet: out of place
    assert out.data_ptr() != seen[0] and torch.equal(x, x0)
    assert ownership.state_inputs_(fresh) == 1
    seen.clear()
    out = fresh(x)
    assert out.data_ptr() == seen[0] and torch.equal(x, x0)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert "activation='elu'" in repr(m) and "activation_param=1.0" in repr(m)


def test_module_compile_fullgraph():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), InPlaceABN(4), nn.Conv2d(4, 2, 1))
    x = torch.randn(2, 3, 6, 6)
    cm = torch.compile(model, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(cm(x).square().sum(), list(model.parameters()))
    want = torch.autograd.grad(model(x).square().sum(), list(model.parameters()))
    for a, r in zip(got, want):
        torch.testing.assert_close(a, r)
    assert int(model[1].num_batches_tracked) == 2


def test_module_compile_inductor_with_kept_channel():
    # the one inductor test: the side tensor's data-dependent size must compile (a zero weight)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), InPlaceABN(4), nn.Conv2d(4, 2, 1))
    with torch.no_grad():
        model[1].weight[2] = 0.0
    ref = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.LeakyReLU(0.01),
                        nn.Conv2d(4, 2, 1))  # fmt: skip
    ref[0].load_state_dict(model[0].state_dict())
    ref[1].load_state_dict(model[1].state_dict())
    ref[3].load_state_dict(model[2].state_dict())
    x = torch.randn(2, 3, 6, 6)
    cm = torch.compile(model, fullgraph=True)
    out = cm(x)
    got = torch.autograd.grad(out.square().sum(), list(model.parameters()))
    want_out = ref(x)
    want = torch.autograd.grad(want_out.square().sum(), list(ref.parameters()))
    torch.testing.assert_close(out, want_out)
    for a, r in zip(got, want):
        torch.testing.assert_close(a, r)


def test_convert_pattern_sequential_bn_act():
    from slimgrad.convert import ConvertConfig, ConvertReport
    from slimgrad.nn.inplace_abn import convert_sequential_bn_act_

    torch.manual_seed(0)

    def build():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.LeakyReLU(0.2),
            nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4), nn.ELU(),
            nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4), nn.ReLU(),
            nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4), nn.LeakyReLU(0.0),  # slope 0: not invertible
        ).double()  # fmt: skip

    ref, model = build(), build()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    rep = ConvertReport()
    convert_sequential_bn_act_(model, ConvertConfig(), lambda m, n: True, rep)
    assert [type(m).__name__ for m in model][:6] == [
        "Conv2d", "InPlaceABN", "Identity", "Conv2d", "InPlaceABN", "Identity"
    ]  # fmt: skip
    assert type(model[7]) is nn.BatchNorm2d and type(model[10]) is nn.BatchNorm2d
    assert [r[0] for r in rep.converted] == ["1", "4"]
    assert model.state_dict().keys() == sd.keys()
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    out, want = model(x), ref(x)
    torch.testing.assert_close(out, want)
    got = torch.autograd.grad(out.square().sum(), list(model.parameters()))
    exp = torch.autograd.grad(want.square().sum(), list(ref.parameters()))
    for a, r in zip(got, exp):
        torch.testing.assert_close(a, r)
    # opt-in: ReLU becomes leaky_relu(slope); a filter keeps a module unchanged
    rep2 = ConvertReport()
    cfg = ConvertConfig(inplace_abn=True, leaky_relu_slope=0.05)
    convert_sequential_bn_act_(model, cfg, lambda m, n: n != "10", rep2)
    assert [r[0] for r in rep2.converted] == ["7"]
    assert model[7].activation == "leaky_relu" and model[7].activation_param == 0.05
    assert type(model[10]) is nn.BatchNorm2d
