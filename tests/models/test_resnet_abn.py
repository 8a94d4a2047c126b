"""torchvision-style ResNets through ``convert_(model, ConvertConfig(inplace_abn=True))``.

The converted model computes the same function as the model with every ReLU swapped for
LeakyReLU(0.01) (the reference here): BN -> ReLU pairs become InPlaceABN(leaky_relu) + a
LeakyReLUAfterABN (identity on its ABNs' outputs, leaky_relu after the residual add); bn3 and the
downsample BN take the exact BatchNorm path (they keep no input: their 1x1 conv is re-run).
"""

import copy

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad import ownership
from slimgrad.memory import measure
from slimgrad.nn.batch_norm import BatchNorm2d
from slimgrad.nn.inplace_abn import (
    _ABN_OUTPUTS,
    InPlaceABN,
    LeakyReLUAfterABN,
    MaxPool2dRecompute,
    RecomputeABN,
)
from slimgrad.ops.batch_norm import _MAX_FEW
from slimgrad.testing import assert_within_rule
from tests.models._resnet_helpers import randomize_bn_, small_resnet

ABN = slimgrad.ConvertConfig(inplace_abn=True)


def _leaky_ref(model: nn.Module, slope: float = 0.01) -> nn.Module:
    # the reference: the same model with each ReLU instance swapped for LeakyReLU(slope)
    new = {}
    for mod in model.modules():
        for n, c in list(mod._modules.items()):
            if type(c) is nn.ReLU:
                mod._modules[n] = new.setdefault(id(c), nn.LeakyReLU(slope, inplace=c.inplace))
    return model


def _pair(block="bottleneck", layers=(1, 2, 1, 1), width=4, seed=0):
    torch.manual_seed(seed)
    base = randomize_bn_(small_resnet(block, width=width, layers=layers), seed)
    return base, _leaky_ref(copy.deepcopy(base)), slimgrad.convert_(copy.deepcopy(base), ABN)


def _grads(model, x0, dtype, inputs=None):
    x = x0.to(dtype).requires_grad_()
    y = model(x)
    y = torch.cat([t.flatten() for t in y]) if isinstance(y, tuple) else y
    w = torch.linspace(-1, 1, y.numel(), dtype=dtype).view_as(y)
    (y * w).sum().backward(inputs=inputs(model, x) if inputs else None)
    grads = [x.grad] + [p.grad for p in model.parameters()]
    return [y] + [g for g in grads if g is not None] + list(model.buffers())


def test_bottleneck_pairs_become_inplace_abn_and_the_rest_exact_batch_norm():
    _, _, ours = _pair(layers=(2, 1, 1, 1))
    assert isinstance(ours.bn1, InPlaceABN) and isinstance(ours.relu, LeakyReLUAfterABN)
    for layer in (ours.layer1, ours.layer2, ours.layer3, ours.layer4):
        for blk in layer:
            # after a 1x1 conv: recompute it (eager's kernels); after the 3x3: in place
            assert type(blk.bn1) is RecomputeABN and type(blk.bn2) is InPlaceABN
            assert (blk.bn2.activation, blk.bn2.activation_param) == ("leaky_relu", 0.01)
            assert type(blk.bn3) is BatchNorm2d  # followed by `+= identity`: exact path
            assert isinstance(blk.relu, LeakyReLUAfterABN) and blk.relu.inplace
            assert blk.bn1._pair_token is blk.relu._pair_token is blk.bn2._pair_token
            if blk.downsample is not None:
                assert type(blk.downsample[1]) is BatchNorm2d
    converted = {n for n, _, _ in slimgrad.report(ours).converted}
    assert {"bn1", "relu", "layer1.0.bn1", "layer1.0.bn2", "layer1.0.relu"} <= converted


@pytest.mark.parametrize("block", ["bottleneck", "basic"])
def test_same_gradients_as_eager_leaky_relu(block):
    # float64: equal to the LeakyReLU model (output, input grad, every Parameter grad, running
    # stats); float32: within the error rule against that float64 reference.
    base, _, _ = _pair(block)
    x0 = torch.randn(3, 3, 33, 31)
    res = {}
    for name, dt, conv in [
        ("ref", torch.float64, False),
        ("ours64", torch.float64, True),
        ("eager", torch.float32, False),
        ("ours", torch.float32, True),
    ]:
        m = _leaky_ref(copy.deepcopy(base)).to(dt)
        if conv:
            m = slimgrad.convert_(copy.deepcopy(base).to(dt), ABN)
            assert isinstance(m.layer1[0].bn1, InPlaceABN)
        res[name] = _grads(m, x0, dt)
    assert len(res["ours64"]) == len(res["ref"])
    for a, b in zip(res["ours64"], res["ref"]):
        torch.testing.assert_close(a, b)
    assert_within_rule(res["ours"], res["ref"], res["eager"])


def test_backward_inputs_subset():
    _, ref, ours = _pair()
    x0 = torch.randn(2, 3, 32, 29, dtype=torch.float64)
    ref, ours = ref.double(), ours.double()

    def subset(model, x):
        return [model.layer1[0].bn1.weight, model.layer2[0].conv2.weight, model.fc.bias]

    got, want = _grads(ours, x0, torch.float64, subset), _grads(ref, x0, torch.float64, subset)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert ours.layer1[0].conv1.weight.grad is None


def test_saved_bytes_formula_and_peak():
    # Eager (LeakyReLU) keeps every BN input + mean and invstd per channel, and the stem max-pool
    # its input + int64 indices. The converted model drops all of them: an InPlaceABN (bn2) keeps
    # its output (= the next conv's input, kept anyway) + 1 float per channel; a RecomputeABN (the
    # stem's bn1, whose max-pool keeps a recipe too, and each block's bn1) keeps a recipe + 2
    # floats per channel (NOTE [Recomputed stem]); bn3 / downsample BNs keep a recipe + 2 floats
    # per channel (mean, invstd, as eager; γ and β kept as themselves, not copies: NOTE [BatchNorm
    # keeps its parameters, not copies] in ops/batch_norm.py), or, with at most 32 values per
    # channel (layer3 and layer4 here), their input, as eager: the default replays no conv there
    # (NOTE [Which convs the default replays] in ops/_derived.py).
    _, eager, ours = _pair(layers=(2, 1, 1, 1), width=8)
    assert type(ours.bn1) is RecomputeABN and type(ours.maxpool) is MaxPool2dRecompute
    x0 = torch.randn(2, 3, 48, 40)
    bn_in, few, hooks = {}, {}, []
    for name, mod in eager.named_modules():
        if isinstance(mod, nn.BatchNorm2d):

            def rec(m, inp, out, name=name):
                bn_in[name] = inp[0].numel() * inp[0].element_size()
                few[name] = inp[0].numel() <= _MAX_FEW * inp[0].shape[1]

            hooks.append(mod.register_forward_hook(rec))
    pool = {}
    hooks.append(eager.maxpool.register_forward_hook(lambda m, i, o: pool.update(i=i[0], o=o)))
    me = measure(lambda: eager(x0 * 1).square().sum())
    for h in hooks:
        h.remove()
    ms = measure(lambda: ours(x0 * 1).square().sum())
    c_abn = sum(m.num_features for m in ours.modules() if type(m) is InPlaceABN)
    c_stem = sum(m.num_features for m in ours.modules() if type(m) is RecomputeABN)
    c_bn = sum(m.num_features for m in ours.modules() if isinstance(m, BatchNorm2d))
    n_bn = sum(1 for m in eager.modules() if isinstance(m, nn.BatchNorm2d))
    assert c_abn > 0 and c_bn > 0 and len(bn_in) == n_bn
    mods = dict(ours.named_modules())
    kept_x = sum(v for k, v in bn_in.items() if few[k] and isinstance(mods[k], BatchNorm2d))
    # an InPlaceABN training on at most 32 values per channel is eager's BatchNorm + in-place
    # activation (NOTE [Few values per channel in InPlaceABN]): its input and 2 floats per channel
    few_abn = [k for k in bn_in if few[k] and type(mods[k]) is InPlaceABN]
    kept_x += sum(bn_in[k] + 4 * mods[k].num_features for k in few_abn)
    assert 0 < kept_x and any(not few[k] and isinstance(mods[k], BatchNorm2d) for k in bn_in)
    pool_bytes = pool["i"].numel() * 4 + pool["o"].numel() * 8
    per_channel = 4 * c_abn + 8 * c_stem + 8 * c_bn
    eager_per_channel = 2 * 4 * (c_abn + c_stem + c_bn)
    assert ms.saved_bytes == (
        me.saved_bytes - sum(bn_in.values()) - pool_bytes - eager_per_channel + per_channel + kept_x
    )
    # Against the matmul-input floor: beyond it only the last block's output (the average pool's
    # input), the loss input, per-channel floats and the few-valued BN inputs.
    last = 2 * ours.fc.in_features * 2 * 2 * 4  # layer4 output: (2, C, 2, 2) float32
    assert ms.floor_bytes == me.floor_bytes
    assert ms.saved_bytes == me.floor_bytes + last + 2 * 10 * 4 + per_channel + kept_x
    assert ms.peak_bytes < me.peak_bytes


def test_convert_is_idempotent_and_state_dict_unchanged():
    base, ref, ours = _pair()
    keys = list(base.state_dict().keys())
    assert list(ours.state_dict().keys()) == keys
    mods = list(ours.named_modules())
    slimgrad.convert_(ours, ABN)
    assert [(n, id(m)) for n, m in ours.named_modules()] == [(n, id(m)) for n, m in mods]
    assert slimgrad.report(ours).converted == []
    # round trip: eager -> converted -> fresh eager, values unchanged
    ours.load_state_dict(ref.state_dict())
    fresh = small_resnet("bottleneck", width=4, layers=(1, 2, 1, 1))
    fresh.load_state_dict(ours.state_dict())
    for (k, a), b in zip(ref.state_dict().items(), fresh.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=k)


def test_parameters_and_buffers_shared_with_the_original():
    torch.manual_seed(0)
    base = randomize_bn_(small_resnet("bottleneck", width=4))
    params = {n: p for n, p in base.named_parameters()}
    bufs = {n: b for n, b in base.named_buffers()}
    slimgrad.convert_(base, ABN)
    assert all(p is params[n] for n, p in base.named_parameters())
    assert all(b is bufs[n] for n, b in base.named_buffers())


def test_a_converted_bn_input_kept_by_a_hook_is_not_written_over():
    # the hook's sin() saves conv2's output for backward: owns_input refuses, the InPlaceABN
    # writes into a new tensor, and the result is the reference's (main wrote over it in place)
    _, ref, ours = _pair()
    ref, ours = ref.double(), ours.double()
    x0 = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    grants = []
    for m in (ref, ours):
        kept = []
        m.layer1[0].conv2.register_forward_hook(lambda mod, i, o, kept=kept: kept.append(o.sin()))
        ownership.reset_reuse_count()
        y = m(x0.clone())
        grants.append(ownership.reuse_count("forward"))
        loss = y.square().sum() + kept[0].sum()
        loss.backward()
    _, free = _pair()[1:]
    ownership.reset_reuse_count()
    free.double()(x0.clone())
    assert grants[1] == ownership.reuse_count("forward") - 1  # only the hooked site refused
    for (n, a), b in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=n)


def test_retain_graph_two_backwards():
    _, ref, ours = _pair()
    ref, ours = ref.double(), ours.double()
    x0 = torch.randn(2, 3, 31, 32, dtype=torch.float64)
    for m in (ref, ours):
        loss = m(x0).square().sum()
        loss.backward(retain_graph=True)
        loss.backward()
    for (n, a), b in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=n)


@pytest.mark.parametrize("mode", ["eval", "no_grad", "inference_mode"])
def test_eval_no_grad_inference_mode(mode):
    # The pairing holds in every mode (no double activation): outputs and running stats as eager.
    _, ref, ours = _pair()
    ref, ours = ref.double(), ours.double()
    x0 = torch.randn(2, 3, 30, 33, dtype=torch.float64)
    if mode == "eval":
        ref.eval(), ours.eval()
    ctx = torch.inference_mode if mode == "inference_mode" else torch.no_grad
    with ctx():
        a, b = ours(x0.clone()), ref(x0.clone())
    torch.testing.assert_close(a, b)
    for a, b in zip(ours.buffers(), ref.buffers()):
        torch.testing.assert_close(a, b)
    assert len(_ABN_OUTPUTS) == 0  # every ABN output was consumed by its ReLU


def test_deepcopy_keeps_pairing_and_registry_is_freed():
    _, ref, ours = _pair()
    twin = copy.deepcopy(ours)
    assert twin.relu._pair_token is twin.bn1._pair_token is not ours.relu._pair_token
    x0 = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    torch.testing.assert_close(twin.double()(x0.clone()), ref.double()(x0.clone()))
    assert len(_ABN_OUTPUTS) == 0


class _Twice(nn.Module):
    # the BN output goes to the ReLU only, whose output goes to the same ReLU again
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3, bias=False)
        self.bn = nn.BatchNorm2d(5)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.relu(self.bn(self.conv(x))))


class _ConvOutReused(_Twice):
    def forward(self, x):
        c = self.conv(x)
        return self.relu(self.bn(c)) + c  # ABN would write over c


class _ViewInput(_Twice):
    def forward(self, x):
        h = self.conv(x)
        return self.relu(self.bn(h[:, :, 1:])), h  # a view: ABN would write over h


class _Branchy(_Twice):
    def forward(self, x):
        h = self.conv(x)
        if h.sum() > 0:  # data-dependent: fx cannot trace it
            h = h * 2
        return self.relu(self.bn(h))


@pytest.mark.parametrize(
    "cls, converted, reason",
    [
        (_Twice, True, None),
        (_ConvOutReused, False, "used only by it"),
        (_ViewInput, False, "used only by it"),
        (_Branchy, False, "not traceable"),
    ],
)
def test_other_modules_exact_or_left_alone(cls, converted, reason):
    torch.manual_seed(1)
    base = cls().double()
    ref = _leaky_ref(copy.deepcopy(base))
    ours = slimgrad.convert_(copy.deepcopy(base), ABN)
    assert isinstance(ours.bn, InPlaceABN) == converted
    if reason:
        assert any(reason in r for _, _, r in slimgrad.report(ours).skipped)
        ref = copy.deepcopy(base)  # nothing changed the function
    x0 = torch.randn(2, 3, 7, 6, dtype=torch.float64)
    got, want = _grads(ours, x0, torch.float64), _grads(ref, x0, torch.float64)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_filter_fn_keeps_a_pair_on_the_exact_path():
    torch.manual_seed(0)
    base = randomize_bn_(small_resnet("bottleneck", width=4))
    ours = slimgrad.convert_(copy.deepcopy(base), ABN, filter_fn=lambda m, n: n != "layer2.0.bn2")
    assert type(ours.layer2[0].bn2) is nn.BatchNorm2d and type(ours.layer2[0].bn1) is RecomputeABN
    assert ("layer2.0.bn2", "BatchNorm2d", "filter_fn returned False") in (
        slimgrad.report(ours).skipped
    )
    # layer2.0's ReLU is leaky everywhere; bn2 -> leaky stays exact through the plain path
    ref = _leaky_ref(copy.deepcopy(base)).double()
    x0 = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    for a, b in zip(_grads(ours.double(), x0, torch.float64), _grads(ref, x0, torch.float64)):
        torch.testing.assert_close(a, b)


def test_leaky_relu_after_abn_module():
    relu = nn.ReLU(inplace=True)
    seen = []
    relu.register_forward_hook(lambda m, i, o: seen.append(1))
    act = LeakyReLUAfterABN.from_torch(relu, 0.2)
    assert act.inplace and act.negative_slope == 0.2
    act(torch.randn(3))
    assert seen == [1]
    with pytest.raises(TypeError, match="expected torch.nn.ReLU"):
        LeakyReLUAfterABN.from_torch(nn.GELU())
    with pytest.raises(ValueError, match="slope 0.2"):
        act.pair(InPlaceABN(3, activation="leaky_relu", activation_param=0.01))
    abn = act.pair(InPlaceABN(3, activation="leaky_relu", activation_param=0.2))
    x = torch.randn(4, 3, 5)
    z = abn(x.clone())
    z2 = z.clone()
    # a copy of the output, or the output changed in place, is not the ABN output: leaky_relu
    torch.testing.assert_close(act(z2), torch.nn.functional.leaky_relu(z, 0.2))
    z.mul_(1.0)
    want = torch.nn.functional.leaky_relu(z.clone(), 0.2)
    torch.testing.assert_close(act(z), want)


class _Stem(nn.Module):
    def __init__(self, k=7):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, k, stride=2, padding=k // 2, bias=False)
        self.bn1 = nn.BatchNorm2d(6)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)

    def forward(self, x):
        return self.maxpool(self.relu(self.bn1(self.conv1(x))))


@pytest.mark.parametrize("train", [True, False])
def test_recomputed_stem_is_eager_bit_for_bit(train):
    # conv -> BN -> ReLU -> max-pool: the recompute path runs eager's own kernels on bit-identical
    # recomputed tensors, so float32 gradients equal eager LeakyReLU's exactly; it keeps nothing
    # full-size (eager: the BN input, the activation and int64 indices).
    torch.manual_seed(3)
    base = randomize_bn_(_Stem(), 3).train(train)
    ref = _leaky_ref(copy.deepcopy(base))
    ours = slimgrad.convert_(copy.deepcopy(base), ABN)
    assert type(ours.bn1) is RecomputeABN and type(ours.maxpool) is MaxPool2dRecompute
    x0 = torch.randn(2, 3, 29, 31)
    for a, b in zip(_grads(ours, x0, torch.float32), _grads(ref, x0, torch.float32)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    ms = measure(lambda: ours(x0 * 1).sum())
    # beyond the conv input: 2 floats per channel (mean and invstd; in eval the running-stat copies)
    assert ms.floor_bytes == x0.numel() * 4
    assert ms.saved_bytes == ms.floor_bytes + 2 * 6 * 4


def test_frozen_conv_no_recipe_falls_back_to_in_place():
    # A frozen conv keeps no input, so there is no recipe: RecomputeABN works in place as
    # InPlaceABN and the max-pool as torch's; gradients still equal eager's.
    torch.manual_seed(4)
    base = randomize_bn_(_Stem(k=3), 4).double()
    base.conv1.weight.requires_grad_(False)
    ref = _leaky_ref(copy.deepcopy(base))
    ours = slimgrad.convert_(copy.deepcopy(base), ABN)
    assert type(ours.bn1) is RecomputeABN
    x0 = torch.randn(3, 3, 17, 13, dtype=torch.float64)
    got, want = _grads(ours, x0, torch.float64), _grads(ref, x0, torch.float64)
    assert len(got) == len(want) == 7  # output, x.grad, γ and β grads, 3 BN buffers
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_autocast_bf16_within_rule():
    _, ref, ours = _pair(layers=(1, 1, 1, 1))
    x0 = torch.randn(2, 3, 32, 32)
    ref64 = _grads(copy.deepcopy(ref).double(), x0, torch.float64)
    res = {}
    for name, m in [("eager", ref), ("ours", ours)]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            res[name] = _grads(m, x0, torch.float32)
    assert len(res["ours"]) == len(ref64)
    assert_within_rule(res["ours"], ref64, res["eager"])


def test_one_value_per_channel_in_training_raises_like_torch():
    ours = slimgrad.convert_(_Stem(k=1), ABN)
    assert type(ours.bn1) is RecomputeABN
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        ours(torch.randn(1, 3, 2, 2))  # conv1 (stride 2) -> 1x1 spatial, batch of one


@pytest.mark.parametrize("block", ["bottleneck", "basic"])
def test_every_abn_site_of_a_torchvision_resnet_takes_the_in_place_path(block):
    # torchvision's layout (``out = self.bn2(out)`` after a conv; the stem's nested
    # ``self.bn1(self.conv1(x))``): every BatchNorm input is a fresh conv output nobody else holds,
    # so ownership grants every InPlaceABN/RecomputeABN call; the result is the reference's
    _, ref, ours = _pair(block=block, layers=(1, 2, 1, 1))
    abns = [m for m in ours.modules() if isinstance(m, InPlaceABN)]
    assert len(abns) == (11 if block == "bottleneck" else 6)  # bn1 (+ bn2) per block + stem
    x0 = torch.randn(2, 3, 32, 32)
    ownership.reset_reuse_count()
    y = ours(x0.clone())
    assert ownership.reuse_count("forward") == len(abns)
    torch.testing.assert_close(y, ref(x0.clone()), rtol=1e-4, atol=1e-4)
